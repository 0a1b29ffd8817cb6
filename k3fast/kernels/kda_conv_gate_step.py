"""Fused KDA decode core: conv1d + SiLU, f_b projection + decay gate, beta, q/k L2 norm, gated delta
rule on the FP32 state, gated output RMSNorm, conv-window and state write-back. One launch.

Replaces k3-spec.md section 7.2 steps 2-8 (everything between the packed input projection
``in_proj_qkvgfab`` and ``o_proj``): the causal conv + SiLU of the 3P q/k/v channels (eq. 2), the
head split and q/k L2 norms (eqs. 3-4), the low-rank decay gate f = bf16(f_a W_fb^T) and
lambda = lb * sigmoid(exp(A_log) (f + dt_bias)) (eq. 5, including the f_b GEMM), beta = sigmoid(b)
(eq. 6), the delta rule S <- S diag(alpha); e = v - S k; S <- S + beta e k^T; o = S q (eq. 7) and
y = w_o * o / rms(o) * sigmoid(g) (eq. 8). T in 1..8 tokens per request run as T sequential steps
(speculative verify); only the state after the T-th token is written back.

Bytes it must move per request (B = 1), P = 128 H, and the floor at 4.3 TB/s:
  recurrent state r+w 2 * H * 64 KiB, conv state r+w 2 * 3P * 3 * 2 B, f_b weight P * 256 B
  (shared by the batch), proj row (4P + 128 + H) * 2 B, y P * 2 B.
  k3_rank(16) (H=6):   786 KB + 27.6 KB + 196 KB + ~8 KB  ~= 1.02 MB  -> 0.24 us  (B=64: 52 MB -> 12 us)
  k3_rank(8)  (H=12): 1573 KB + 55.3 KB + 393 KB + ~15 KB ~= 2.04 MB  -> 0.47 us  (B=64: 104 MB -> 24 us)
  full / TP1  (H=96): 12.6 MB + 442 KB + 3.1 MB + ~0.1 MB ~= 16.3 MB  -> 3.8 us   (B=64: 0.83 GB -> 193 us)
At B=1 the kernel is latency-bound (a chain of dependent steps after the PDL wait), at B >= 16 it is
bandwidth-bound on the state.

Launch: grid (NS, H, B), cluster (NS, 1, 1), 128 threads (4 warps). The NS CTAs of a cluster share
one (request, head) and split the 128 value rows of its state (R = 128/NS rows per CTA, R/4 per
warp, lane l owns keys 4l..4l+3 as one float4: 16-byte loads, k contiguous). NS = 8 when B*H <= 64
(k3_rank16 B <= 10, k3_rank8 B <= 5), else 4. CTAs at B=1: 48 (rank16), 96 (rank8), 384 (full).
Why not more CTAs at rank16 B=1: clusters > 8 are non-portable on sm_90, and the CTA count does
not shorten the critical path: each CTA's 8 KB of state is loaded into registers BEFORE the PDL
wait, so what remains after the wait is proj loads (L2), the conv, the f_b dot products, two
cluster barriers and the recurrence of 4 rows per warp; none of it scales with the row count.
Every CTA recomputes its head's q/k conv (256 channels, 1.5 KB of taps + 0.5 KB of proj per token,
L2 hits) so no q/k exchange is needed. The f_b projection is split: CTA s computes f for the key
channels [sR, sR+R) of its head (R rows x 128 of W_fb = 4-8 KB) and pushes alpha into every
cluster CTA's shared memory (st.shared::cluster); one cluster barrier publishes it. The gated norm
needs sum(o^2) over all 128 rows: each CTA pushes its per-token partial into every peer's smem,
a second cluster barrier, then every CTA sums the NS partials in the same fixed order (bitwise
identical rstd in all CTAs, deterministic).

Conv-state race: the q/k conv window of a head is READ by all NS CTAs but WRITTEN only by split 0,
and only after the first cluster barrier; every CTA consumed its window loads (the conv outputs
went to smem) before arriving, so no CTA can read a window that split 0 already shifted. The v
channels [2P + hD + sR, +R) are read and written only by CTA s.

Contracts:
* PDL: rec_state, conv_state, weights and `slots` are read BEFORE griddepcontrol.wait. They must not
  be written by the kernel launched immediately before this one (slots come from host-side batch
  setup; the states were written by this kernel in the previous decode step of the same layer).
  proj is read, and y, conv_state, rec_state are written, only after the wait. The kernel fences
  its state writes (fence.acq_rel.gpu) before griddepcontrol.launch_dependents at the very end, so a
  dependent launch's pre-wait state loads see them; two back-to-back launches on the same slots work
  (tests/gpu test_back_to_back_steps). Moving the trigger earlier would let o_proj start its weight
  prologue sooner, but then a following KDA step must not read the state before its wait.
* slots[b] < 0: padding; no state is read or written, y rows are zeros. slots[b] >= S (caller
  error, checked in-kernel without a host sync): no state is touched and the y rows are NaN so the
  error cannot pass silently. Two requests with the same slot: undefined (caller error).
* u (conv output) stays FP32; f is rounded to bf16 like a bf16 GEMM output; state FP32.

Version log
  v1: as above. ptxas sm_90a (remarks{ptx}), 128 threads, 0 spill stores/loads for every key:
      NS=8: 64 regs at T=1, 93-100 at T=2..8;  NS=4: 96 regs at T=1, 126-134 at T=2..8
      (same for H = 6, 12, 96). Compile ~2.6 s per key on the 2-core CPU box.
      Measured (kernels-11595c4.json): rank16 b1/b8/b64 9.2 / 10.8 / 30.7 us against fla 0.6.0 + slot glue 28.9 /
      41.5 / 52.8 us (3.2x / 3.8x / 1.7x); full b1/b8/b64 13.3 / 52.4 / 355 us (floor 3.9 / 25.7 / 200; fla 32 / 78 /
      361).  Correct at every tested batch, T and padding (60/60).
      Expected (then): B=1 rank16/rank8 ~3-5 us (latency: PDL wait, L2 proj loads,
      two cluster barriers, 2 x 4 dependent warp reductions per token); B=64 rank16 ~13-16 us
      (~3.3-3.8 TB/s on the 52 MB, NS=4 runs 3 CTAs/SM at 128 regs; nsplit=8 is the alternative
      to try there: 64 regs, more CTAs in flight, 2x the L2-served q/k/W_fb re-reads).
  v2 (2026-11-29, session 6; early_trigger=True, FastImpl attn_early_trigger, the default since 001a431) The PDL
      dependents launch right after this kernel's own wait instead of at its end. In the rank16 b1 chain
      (records-c90da94-kdaall.json, flushed timeline) o_proj + AttnRes #2 starts at 26.3 us, when this kernel ends
      (26.2), and then spends 9.4 us streaming 11 MB (floor 2.6 us): nothing of it overlapped the 5.4 us of KDA.
      Safe in the chain: o_proj reads no KDA state, and any later kernel starts only after o_proj has passed its
      own wait, i.e. after this grid completed (every kernel of the chain triggers after its wait). Not safe for
      a second KDA step launched directly behind this one (test_back_to_back_steps keeps the default).
      Prediction: o_proj's weights stream during the KDA step, so the attention half b1 -2 to -3 us.
      Measured with rms_gemv v5 (records-001a431-s8.json, fast-trig against fast, flushed timelines): attention
      half b1 39.6 -> 36.5 us (1.79x stock). The KDA CTAs now launch at 2.4 us instead of 20.9, and o_proj at
      21.4 instead of 26.2; o_proj ends 6.8 us after the KDA step instead of 9.6. b8 / b64 unchanged (o_proj is
      on cuBLAS there). GPU-tested: test_fast_attention_half at b1-4, tp16 and tp8, and test_back_to_back_steps
      (default trigger).
  v3 (2026-11-29, session 6; PRELOAD, the default since session 7; "fast-s8" is the A/B without it) At T = 1 and
      nsplit 8, every value a thread reads from proj is loaded right after the wait: the q/k/v conv inputs, the
      beta logit, the f_a vector and the output gate. In v2's SASS the beta and f_a loads sat behind the conv
      sigmoids' division branches, and the gate load came after the last cluster barrier (k3fast.measure.ptxcheck: 6
      loads behind a branch, 3 with the preload). Results are bit-identical. ptxas 12.9: 64 -> 71 registers at
      nsplit 8, no spills; nsplit 4 would spill 8 bytes, so it keeps v2 (traces/cpu/ptxcheck-cb84e2ba91f3.json). Prediction: the KDA step at b1 -1 to
      -1.5 us (2-3 L2 round trips), most of it on the attention half's critical path.
      Measured (kernels-84291ed.json, records-84291ed-s9perf.json, one run; GPU tests passed,
      logs/gpu-junit-84291ed-s9tests.xml): kernel bench b1 / b2 / b4 / b8 8.9 -> 8.4, 9.3 -> 8.5, 9.8 -> 9.1,
      11.0 -> 10.2 us; attention half b1 36.7 -> 36.1 us (fast-kdapre). Met at the kernel (-0.5 to -0.8 us), the
      low end in the layer. The default from 84291ed's successor on (PRELOAD = True; "fast-s8" keeps v2).
  v4 (2026-11-30, session 9; measured slower and removed in the same session; the code is at d875e46) The request
      loop: where the one-request grid needs a second wave (nsplit 4, B*H*4 CTAs above 5 per SM), launch only the
      clusters that fit at 4 CTAs per SM (a 128-register cap) and loop each over requests b, b + G, ..., with the next
      request's state rows in flight (cp.async into the other of two smem stages) and its conv windows in registers.
      Why: at rank16 b64 the 1536 CTAs run in ~2.3 waves, and a later wave's state loads start only when an earlier
      CTA's whole chain ends. Predicted: kernel rank16 b64 ~30 -> ~15-18 us, attention half b64 65.3 -> ~53-56.
      Measured (kernels-d875e46-s17.json, records-d875e46-s17.json, one run, copy 4.193 TB/s): kernel rank16 b64
      30.9 -> 37.6 us (half the groups: 41.5), rank8 b64 53.7 -> 70.1, full b8 / b64 52.7 / 352.8 -> 61.4 / 427.3;
      attention half rank16 b64 65.2 -> 70.3, rank8 117.5 against 102.4. MISSED, the other way. The GPU tests
      against the reference passed, but the bit-identity test against the one-request grid did not (y differed; not
      chased, the variant was removed). The per-item arithmetic explains the miss: per SM, a CTA-request cost ~2.7 us
      in the one-request grid, 3.2 us in v4 and 3.6 us at half the groups, so the step is not bound by waves of
      state loads but by each CTA's chain, which v4 ran with fewer CTAs per SM. ncu then showed what the chain waits
      on (next entry).
  v5 (2026-11-30, session 9; LATE_STORES, the default; "fast-s17kda" is the A/B without it) Nsight Compute at rank16
      b64 (ncu1 at 5446d13, traces/h200/ncu-5446d13-ncu1/): 16.2 cycles per issued instruction, of which "membar"
      3.45, the second cause after long-scoreboard (5.0); DRAM at 21 % of peak. In the SASS each cluster barrier's
      arrive (release semantics) is MEMBAR.ALL.GPU + UCGABAR_ARV and each wait CCTL.IVALL, and the kernel ends with
      another MEMBAR.ALL.GPU (the fence before the trigger). v3 issued the conv-window stores before phase B and the
      16 KB of state rows per CTA before phase C's cluster barrier, so that barrier's MEMBAR waited for them to
      complete GPU-wide, and the end fence waited again, even behind the early trigger, where it orders nothing for
      the already-launched dependent. v5 issues every write-back after the last cluster barrier and, with the early
      trigger (the layer's configuration), drops the end fence. Bit-identical by construction (GPU test). ptxas:
      96 / 72 registers at nsplit 4 / 8 (v3: 96 / 71), no spills.
      Prediction: kernel bench with the early trigger ("@trig" against "@v3trig") rank16 b64 -15 to -20 % (~30.9 ->
      ~25-26 us), b1 -0.3 to -0.6 us; attention half rank16 b64 65.2 -> ~60-61 us, b1 -0.3 to -0.6 us.
      Measured (kernels-ee5c807-s18.json, records-ee5c807-s18.json, one run; GPU tests 90 passed, bit-identical):
      kernel with the early trigger rank16 b64 30.9 -> 28.1 us (-9 %), rank8 52.8 -> 48.2, full b8 54.0 -> 48.4,
      full b64 359.9 -> 330.1; b1 8.6 -> 8.1 (rank8 9.0 -> 8.6). Without the early trigger (fence kept) nothing
      moved (30.5 against 30.4), so the gain is the end fence, not the barrier MEMBARs. Attention half (fast-s17kda
      -> fast): rank16 b64 64.7 -> 62.1 us, rank8 102.2 -> 95.9; b1 / b8 unchanged (the dependent waits for the
      grid's completion, which drains the stores as the fence did). ncu rank16 b64 (ncu-ee5c807-s18/): membar
      stalls 3.25 -> 1.47 cycles per issue, duration 28.8 -> 26.5 us. Half the predicted kernel gain at b64, met
      at b1 in the kernel, nearly met in the attention half at b64.
  v6 (2026-11-30, session 9; DSMEM_TX, the default since session 10; "fast-s19kda" is the A/B without it) The two
      cluster exchanges (alpha of every f channel; the per-CTA sums of o^2) become st.async stores into the peers'
      shared memory, each completing 4 bytes of a transaction on the peer's mbarrier at the same offset (a CTA's
      own values are plain shared stores: st.async to the executing CTA is undefined). Each CTA expects its peers'
      (D - R) x T and (NS - 1) x T floats on two single-use mbarriers (thread 0's arrive.expect_tx, before the
      start's cluster arrive, after fence.mbarrier_init), and waits on them where v5 had the cluster barriers; a
      CTA barrier after each wait orders the CTA's own stores. No cluster barrier remains after the start (whose
      wait every CTA passes before its first remote store), and no gpu-scope fence: in the SASS the two
      MEMBAR.ALL.GPU + UCGABAR + CCTL.IVALL sequences of v5 become SYNCS.PHASECHK waits
      (traces/cpu/ptxcheck-2cd6d9c758fe.json has both builds' sizes). The conv-window race stays closed: v6 needs
      v5's late write-backs, and a peer's norm partial arrives only after it consumed its window. Every CTA waits
      for all the bytes sent to it before it ends, so no st.async targets an exited CTA. Bit-identical to v5 (the
      same values in the same smem slots; GPU test). ptxas: 72 / 96 registers at nsplit 8 / 4, T = 1 (v5 72 / 96),
      135 at T = 4 (v5 128: 3 CTAs per SM at T > 1).
      Why: ncu at b1 (ncu-5446d13-ncu1/): membar 2.2 of 11.9 stall cycles per issue, i.e. ~1.2 of the step's 6.8
      us; the two MEMBAR.ALL.GPU sit on the chain after the in_proj.
      Prediction: kernel bench with the early trigger rank16 b1 8.1 -> ~7.2-7.6 us, b64 28.1 -> ~26-27; attention
      half b1 -0.5 to -1 us (34.0 -> ~33-33.5), b64 -1 to -2 us.
      Measured (kernels-2674eff-s19.json, records-2674eff-s19.json, one run, copy 4.065 TB/s; bit-identical to v3 and
      v5 in the GPU test, logs/gpu-junit-2674eff-s19.xml; its reference test failed on a test bug, check_step did not
      take dsmem_tx, fixed after). Kernel bench with the early trigger, v5 -> v6 (us): rank16 b1 8.10 -> 8.16, b8
      10.43 -> 9.92, b16 12.64 -> 12.32, b64 28.48 -> 27.33; rank8 b1 8.70 -> 8.32, b8 12.64 -> 12.38. Attention
      half (fast -> fast-kdatx): rank16 b1 34.4 -> 33.4, b8 42.1 -> 41.2, b64 63.1 -> 62.4; rank8 b1 48.1 -> 47.3,
      b8 55.7 -> 56.0, b64 95.6 -> 95.7. MISSED in the kernel at b1 (no change, not -0.5 to -0.9 us): the membar
      stalls were not what held the b1 chain; near at b64 (-4 %, predicted -4 to -7 %); the attention half moved
      by its predicted -0.5 to -1 us at b1 but not at rank8 b8 / b64. Kept as the default: it is never slower by
      more than run-to-run noise and removes the gpu-scope fences from the chain.
  v7 (2026-11-30, session 11; opt-in min_blocks, impl "fast-kdaocc6", bench row kda_conv_gate_step@occ6trig;
      removed in session 12 after the measurement below, the code is at 0e81145; CPU-compiled, measured by
      h200_next s24) An occupancy hint for the large-batch build (nsplit 4, T = 1): ptxas is asked for 6
      resident CTAs per SM (nvvm.minctasm, a cap of 85 registers at 128 threads) instead of the 5 that its 96
      registers allow.
      Why: ncu at rank16 b64 (ncu-ee5c807-s18/, v5) shows 1536 CTAs in 2.33 waves at 5 CTAs per SM, limited by
      registers ("Block Limit Registers 5"), with DRAM 22 % busy and 14.2 cycles per issued instruction, long
      scoreboard the largest stall. Each CTA loads its 16 KB of state and then runs a latency-bound chain (conv,
      gate, two exchanges, the recurrence, the norm). The SMs run 11.6 CTAs each, in 3 rounds of 5; at 6 per SM
      that is 2 rounds, each with 20 % more state in flight. (v4's persistent request loop and nsplit 8 were the
      other two ways to more concurrency, and both lost: version log v4, choose_nsplit.)
      ptxas 12.9 (rank16 and rank8 alike): 80 registers and 16 spill bytes at T = 1 (96 and 0 without the hint).
      At 8 CTAs (64 registers) it spills 124 bytes, and T > 1 would spill 144-272, so the hint is for T = 1 only.
      Bit-identical: the same code with another register allocation (GPU test).
      Prediction: kernel with the early trigger rank16 b64 27.3 -> ~21-24 us, rank8 b64 (3072 CTAs: 5 rounds ->
      4) ~43 -> ~36-40; attention half rank16 b64 62.1 -> ~57-60 us; b1 / b8 unchanged (nsplit 8 there).
      Measured (s24 at 0e81145, kernels-/records-0e81145-s24.json, one run): MISSED, rank16 b64 unchanged. Kernel
      bench with the early trigger (@trig vs @occ6trig): rank16 b16 12.00 vs 12.61 us, b64 27.62 vs 27.62; rank8
      b16 18.43 vs 18.62, b64 47.39 vs 45.79. Attention half (fast vs fast-kdaocc6): rank16 b8 40.7 vs 40.8, b64
      62.0 vs 62.1; rank8 b8 55.7 vs 56.3, b64 95.5 vs 94.5. Only rank8 b64 moved (-3.4 % in the kernel, -1 % in
      the attention half), within what one run can tell, and b16 got slower. If the hint gave the 6 resident CTAs
      it asked for (ptxas on the CPU: 80 registers, 16 spill bytes; not checked in ncu), 2 rounds instead of 3
      saved nothing at rank16 b64, and more CTAs in flight is the third way to concurrency (after v4's persistent
      loop and nsplit 8) that did not pay. Removed in session 12 (the code is at 0e81145).
  v8 (session 19; opt-in mid_trigger with early_trigger, impls "fast-kdamid" / "fast-op32mid"; measured at s61 and
      removed in the same session, the code is at e3ab9f1) The early trigger moved from right after the wait to
      after phase A's exchange (every proj load of the CTA is back by then). Why: three o_proj designs that brought
      its weight bytes into this kernel's window (oproj_attnres v1.3, v1.4, v1.6) each made this kernel longer by
      about what o_proj saved after it (s60: 6.3 -> 8.9 us at rank8 b1 with v1.6's 22 MB in flight). The contract
      is early_trigger's and the trigger is later, so it is no weaker; bit-identical (GPU test, 4 cases passed).
      Prediction (written before s61): KDA step at rank8 b1 with v1.6 8.9 -> ~6.5-7 us; attention half rank8 b1
      fast-op32mid -1.5 to -3 us against fast; fast-kdamid and rank16 within +-0.5.
      Measured (s61 at e3ab9f1, records-e3ab9f1-s61.json, one run, no stock, copy 4.114 TB/s; GPU tests 10 passed).
      The KDA step got shorter, past the prediction: rank8 b1 6.2 -> 4.8 us (64 rows), 9.2 -> 5.1 (32 rows), rank16
      b1 6.1 -> 4.9. But o_proj launched ~1.5 us later and then ended 10.4 us after the KDA step (8.2 with the early
      trigger, 5.2 with v1.6), so the attention half got longer: rank8 b1 fast / fast-kdamid / fast-op32mid 41.7 /
      44.1 / 43.7 us, b2 46.6 / 47.3 / 46.8, rank16 b1 30.4 / 31.5 / 31.3. MISSED, the other way. It confirms the
      cause s60 inferred (o_proj's stream is what lengthens the KDA step) and shows the trade is about even: the
      bytes o_proj reads during the KDA step cost the KDA step about what they save o_proj after it. Removed.
  v9 (session 22; nsplit 1, as run opt-in: HEAD_CTA_MIN = None, impls "fast-kdahead" (from 192 request-heads) and
      "fast-kdahead48", bench row kda_conv_gate_step@ns1trig) The large-batch build: one CTA of 8 warps per (request,
      head), no cluster. Thread 0 bulk-copies the head's 64 KB of state into shared memory (4 x 16 KB on one
      mbarrier) as the CTA's first act, before the PDL wait; the threads update the rows there (warp w rows 16w..16w+15,
      a row at a time: load, decay, the two dot products, store) and thread 0 hands them back to the HBM by bulk
      stores as soon as the last row is final, while the norm and y are computed. The q / k conv, f_b and the decay
      gate are computed once per head instead of once per split, with W_fb's rows in registers before the wait;
      alpha and the norm's partials go through the CTA's own shared memory (no exchange, no mbarrier for them).
      Numerics: every row, channel and reduction as nsplit 4 computes it, the gated norm's sum of o^2 as its four
      32-row warp sums added in the same order, so y and both states equal nsplit 4's bit for bit (GPU test). ptxas
      12.9: 80 registers at T = 1 (3 CTAs per SM asked, min_blocks_per_mp; 68 KB of shared memory each), 0 spills;
      T > 1 at 2 CTAs per SM (128 registers).
      Why: at rank16 b64 the nsplit 4 grid is 1536 CTAs of 16 KB in 2.33 waves, and ncu (ncu-ee5c807-s18/) shows
      DRAM 22 % busy, 4.15 of 5 warps active per scheduler, 14.2 cycles per issued instruction (long scoreboard 5.4,
      membar 1.5, barrier 1.3, short scoreboard 1.3): each CTA's ~1060 instructions per warp are a latency chain
      (slot -> state loads, proj -> conv -> f -> alpha exchange -> rows -> norm exchange -> stores) of ~7.7 us, and a
      later wave's state loads start only when an earlier CTA ends. Three ways to more concurrency inside that
      design lost (v4's request loop, v7's 6 CTAs per SM, nsplit 8). v9 changes the design instead: its 384 CTAs
      (rank16 b64) are one wave at 3 per SM, every CTA's state bytes are requested at its start without costing
      registers, and the per-CTA chain has no cluster exchange and does the head's conv / gate work once (nsplit 4
      did it four times). rank8 b64 is 768 CTAs, two waves.
      Prediction (kernel bench with the early trigger, @ns1trig against @trig): rank16 b64 27.3 -> ~14-18 us, rank8
      b64 ~45 -> ~28-34; b16 about even; b1 / b8 slower (6-96 CTAs of 16 rows per warp). Attention half rank16 b64
      62.0 -> ~51-55 us (fast-kdahead against fast; 1.49x -> ~1.7-1.8x stock), rank8 b64 95.4 -> ~78-84. If the
      kernel does not move at b64, the chain after the wait (not the state stream) is what bounds it, and the next
      evidence is ncu of v9.
      Measured (s69 at 5329817, kernels-/records-5329817-s69.json, one run, copy 4.22 TB/s; GPU tests 40 passed: the
      reference at B 1..64 and T 1..8, bit-identical to nsplit 4, back-to-back, graph replay, the attention half):
      kernel @trig / @ns1trig rank16 b1 7.5 / 13.5 us, b8 9.8 / 14.1, b16 12.4 / 14.9, b64 27.4 / 25.3; rank8 b1
      8.4 / 13.9, b8 12.4 / 15.2, b16 18.3 / 18.0, b64 47.1 / 45.4. Attention half (fast / fast-kdahead / stock)
      rank16 b64 62.2 / 60.4 / 92.9, rank8 b64 96.0 / 93.2 / 126.8; fast-kdahead48 at b8 35.0 -> 41.8 (rank16),
      51.4 -> 58.8 (rank8). MISSED: -8 % at b64 where -35 to -50 % was predicted.
      Nsight Compute at rank16 b64 (s70 at 8f943aa, ncu-8f943aa-s70/: the per-SASS stall samples): 3 CTAs per SM as
      asked (80 registers, 68 KB), 0.97 waves, 23.5 us, DRAM 25 % busy, 20.3 cycles per issued instruction (long
      scoreboard 8.4, short scoreboard 4.8). By instruction: 34 % of the samples sit at phase A's first uses of the
      conv windows (loaded before the wait, but after the 64 KB bulk copies, so behind 25 MB of bulk traffic: they
      return with the last of it); ~25 % in phase B, whose SASS runs each row as one chain (load, 4 FFMA, 5 shuffles,
      update, 5 shuffles, store: ~400 cycles x 16 rows per warp); ~20 % at the exit (the storer waiting for the
      bulk store's read, the others at EXIT). So the one-wave CTAs run load -> compute -> store in lockstep: the
      HBM idles while they compute and the SMs idle while the state streams. row_group 4 (4 rows loaded, then
      updated) measured 23.6 against 25.4 us at rank16 b64, 41.6 against 45.6 at rank8 b64 (s70).
  v9.1 (session 22; the v9 build since c50e22f, row_group 4 its default) The CTA's load / compute / store
      overlapped by chunk: each 16 KB chunk (32 rows) of the state has its own mbarrier, the two warps owning its
      rows start on it as soon as it lands, and when both are done with it (a named barrier of the two) its first
      lane bulk-stores it, while the other chunks still stream in or are being updated. The bulk copies are issued
      after the thread's own register loads (slot, conv windows and weights, W_fb, dt_bias), so phase A's inputs are
      not queued behind the state. Bit-identical to v9 and nsplit 4 (the same values; GPU test).
      Prediction (kernel @ns1trig against @trig, and against s70's @ns1g4trig 23.6 / 41.6): rank16 b64 ~12-16 us,
      rank8 b64 ~25-32 (the first chunk of every CTA arrives after ~1/4 of the stream, and the last chunk's rows,
      the norm and a 16 KB store follow the stream's end); b16 within +-1 us of nsplit 4. Attention half rank16 b64
      62 -> ~50-54 us (1.7-1.85x stock), rank8 b64 96 -> ~78-85. If it misses, the per-row chain of phase B (~3 us
      at row_group 1, ~1.5 at 4) is what is left on the critical path: rows split over lane pairs (no shuffles but
      one) is the next change.
      Measured (s71 at 7a01a10, kernels-/records-7a01a10-s71.json, one run, copy 4.21 TB/s; GPU tests 33 passed,
      bit-identical to nsplit 4 and to row_group 1): kernel @trig / @ns1trig / @ns1g1trig rank16 b64 27.6 / 21.2 /
      23.2 us, b16 12.6 / 12.9 / 14.6, b8 9.2 / 11.8 / 13.3; rank8 b64 47.4 / 36.8 / 39.7, b16 18.2 / 15.9 / 17.2,
      b8 12.5 / 12.8 / 14.4. Attention half (fast / fast-kdahead / stock) rank16 b64 61.9 / 56.0 / 90.9, rank8 b64
      96.1 / 85.1 / 124.1, rank8 b16 63.1 / 60.3 / 101.6. The kernel prediction MISSED (21.2 against ~12-16: a
      third of the way from v9 to the floor); the attention half met it at rank8 (85.1 in ~78-85) and missed at
      rank16 by ~2 us. The default from 192 request-heads since 6c06043 (HEAD_CTA_MIN; at 96 it was even, below
      slower); s72 (records-9daeda3-s72.json): attention half rank16 b64 62.1 -> 55.7 us (fast-s22kda -> fast;
      stock 93.7), rank8 b64 95.2 -> 83.8 (stock 126.4).
  v9.2 (session 24; proj_first, HEAD_PROJ_FIRST, the default since s84; measured as "fast-kdapf" and bench row
      kda_conv_gate_step@ns1pftrig, "fast-s24kda" is the A/B)
      After the PDL wait every thread first requests the first token's projections (its q / k or v channel and its
      f_a vector), a CTA barrier, and only then does thread 0 issue the state's bulk copies (v9.1 issued them before
      the wait). Later tokens (T > 1) load as before. Same values in the same order: bit-identical to v9.1 (GPU test
      test_proj_first_is_bit_identical). ptxas (13.0, sm_90a): 80 registers at T = 1 as v9.1, 127 at T = 4 (128), no
      spills. v9.1's PTX is unchanged by the option (compared on the CPU).
      Why (s80 at c22210d, ncu-c22210d-s80/: v9.1 alone at rank16 b64, 19.1 us): 23.5 % of the stall samples wait at
      the CTA barrier that ends phase A and ~10 % on first uses of register loads issued before the wait (conv
      windows and weights: v9.1 issues them before the state's copies, yet thread 0 itself stalls on one before it
      reaches the copies; the prediction below read the 6.5 % FMUL as a wait on the projections, which the SASS
      listing does not support), while the state's chunk mbarriers are already complete when phase B starts (0.2 %).
      Phase A's inputs all come back while 25 MB of bulk copies are in flight, so phase A, not the state stream,
      set the start of phase B. In the layer v9.1
      runs from 192 request-heads (rank16 b32 / b64, rank8 b16+), behind cuBLAS's in_proj, which does not trigger
      early: the copies issued before the wait overlapped nothing there.
      Prediction: the KDA step in the layer at rank16 b64 17.5 -> ~13-15.5 us; attention half rank16 b64 -2 to -4.5
      us (54.1 -> ~49.5-52), rank8 b64 -3 to -6 (83.9 -> ~78-81), rank8 b16 -1 to -2 (58.5 -> ~56.5-57.5); the
      kernel bench @ns1pftrig against @ns1trig at b64 -2 to -5 us. If the bench moves (cold L2: the projections
      come from HBM there) and the layer does not, the layer's projection loads were L2 hits that the bulk traffic
      did not delay, and ncu's cold picture does not carry over to the graph.
      Measured (s84 at 92d0ab6, kernels- and records-92d0ab6-s84.json, one run, copy 4.23 TB/s; GPU tests 12 passed:
      bit-identical to v9.1 at B 3 / 5 / 16 / 64, T 1 / 4 / 8, both triggers, and the attention half with it at
      rank16 b64 and rank8 b16). Kernel bench @ns1trig -> @ns1pftrig (cold L2): rank16 b64 21.1 -> 20.3 us, b16
      (bench only: the layer runs the cluster build there) 12.1; rank8 b64 36.4 -> 34.5, b16 15.9 -> 15.4. In the
      layer the KDA step: rank16 b64 17.9 -> 16.5 us, rank8 b64 32.4 -> 30.4, rank8 b16 12.5 -> 12.5. Attention
      half (stock / fast / fast-kdapf): rank16 b64 91.3 / 54.0 / 53.3 (1.71x), rank8 b64 123.4 / 84.2 / 81.3
      (1.52x), rank8 b16 101.6 / 58.4 / 58.4 (1.74x). MISSED: -0.7 where -2 to -4.5 was predicted at rank16 b64, 0
      at rank8 b16 (-1 to -2), -2.9 at rank8 b64 (-3 to -6, at the edge); the bench moved -0.5 to -1.9 (-2 to -5
      predicted). Not measured, so inference: the barrier's share in s80's samples came mostly from the
      projection loads' latency under the bulk traffic, of which the earlier issue removes part; the rest of phase
      A (the conv, the f_b reductions, alpha through shared memory) and the 0.97-wave grid's store drain remain. No
      cell got slower and the kernel bench moved the same way at all four, so the default from s84.
"""
from __future__ import annotations

from typing import Iterable

from ._dsl import (check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, sigmoid,
                   st_shared_cluster_f32, TVM_FFI)

HEAD_DIM = 128
MAX_T = 8
# v3 (the default since session 7; "fast-s8" is the A/B without it): at T = 1 the proj loads are issued together
# right after the PDL wait (the version log says why)
PRELOAD = True
WARPS = 4
# v5 (the default from session 9; "fast-s17kda" is the A/B without it): the conv-window and state write-backs after
# the last cluster barrier, and no end fence behind the early trigger (the version log says why)
LATE_STORES = True
# v6 (the default from session 10; "fast-s19kda" is the A/B without it): the two cluster exchanges as st.async +
# mbarrier complete_tx instead of cluster barriers, whose release arrive is MEMBAR.ALL.GPU (the version log says why)
DSMEM_TX = True
# (v7, an occupancy hint of 6 CTAs per SM for the nsplit-4, T = 1 build, was measured and removed in session 12:
# version log)
# v9.1 (the default from 192 request-heads since session 22; "fast-s22kda" is the A/B without it, bench row
# kda_conv_gate_step@ns1trig): nsplit 1, one CTA of HEAD_WARPS warps per (request, head) with the state in shared
# memory, chosen when batch x heads >= HEAD_CTA_MIN (None: never). s71: -22 / -23 % at rank16 / rank8 b64, -13 % at
# rank8 b16 (192 request-heads); about even at 96 (rank16 b16 +0.3 us, rank8 b8 +0.3), slower below
HEAD_WARPS = 8
HEAD_CHUNKS = 4             # bulk copies per 64 KB state (16 KB each), in and out
HEAD_ROW_GROUP = 4          # state rows a warp loads before updating them (s70: 4 faster than 1, @ns1g1trig)
# v9.2 (the default since s84; "fast-s24kda" is the A/B without it, bench rows kda_conv_gate_step@ns1trig (v9.1,
# proj_first=False there) and @ns1pftrig): the first token's projections before the state's bulk copies, the copies
# after the PDL wait. s84: attention half rank16 b64 -0.7 us, rank8 b64 -2.9, rank8 b16 +0.1 (version log)
HEAD_PROJ_FIRST = True
HEAD_CTA_MIN = 192
NSPLITS = (1, 4, 8)


def proj_width(heads: int, head_dim: int = HEAD_DIM) -> int:
    """Np: row width of the packed projection [q P | k P | v P | g P | f_a 128 | b H | pad to 16]."""
    p = heads * head_dim
    return (4 * p + head_dim + heads + 15) // 16 * 16


_MODULE = object()


def choose_nsplit(batch: int, heads: int, head_min=_MODULE) -> int:
    """Value-row splits per (request, head): 8 for small B*H (fill the GPU), 4 above (less
    redundant q/k conv and proj traffic per CTA, 8 state rows per warp still fit registers).
    Checked on the H200 (kernels-0bc90c0.json, rank16): nsplit 8 at b64 took 34.0 us against 30.9, and nsplit 4 at b4
    9.9 against 9.1; the attention half A/B is "fast-kdans8" (records-0bc90c0-s11.json).
    1 (v9, one CTA per (request, head), state in shared memory) from B*H >= head_min (default HEAD_CTA_MIN; None:
    never)."""
    if head_min is _MODULE:
        head_min = HEAD_CTA_MIN
    if head_min is not None and batch * heads >= head_min:
        return 1
    return 8 if batch * heads <= 64 else 4


def compile_key(heads: int, T: int, nsplit: int, lower_bound: float = -5.0, eps: float = 1e-5,
                head_dim: int = HEAD_DIM):
    return ("kda_conv_gate_step", int(heads), int(head_dim), int(T), int(nsplit), float(lower_bound), float(eps))


def kernel_key(heads: int, T: int, nsplit: int, lower_bound: float = -5.0, eps: float = 1e-5,
               head_dim: int = HEAD_DIM, *, early_trigger: bool = False, preload=None, late_stores=None,
               dsmem_tx=None, row_group=None, proj_first=None) -> tuple:
    """compile_key plus the build flags kda_conv_gate_step runs for these options (None: the module default).
    nsplit 1 (v9) has no cluster exchanges and always writes back after its last step: preload, late_stores and
    dsmem_tx do not apply to it and are ignored; proj_first (v9.2) applies to it only."""
    if nsplit == 1:
        rg = HEAD_ROW_GROUP if row_group is None else int(row_group)
        if rg not in (1, 2, 4, 8, 16):
            raise ValueError(f"row_group must be 1, 2, 4, 8 or 16 (state rows a warp loads at once), got {row_group}")
        pf = HEAD_PROJ_FIRST if proj_first is None else bool(proj_first)
        return (compile_key(heads, T, nsplit, lower_bound, eps, head_dim)
                + (("early_trigger",) if early_trigger else ()) + ("head",) + ((f"rows{rg}",) if rg != 1 else ())
                + (("proj_first",) if pf else ()))
    # NS = 4 (the large-batch split) spills 8 bytes with the preload at 96 registers (ptxas 12.9): NS = 8 only
    pre = (PRELOAD if preload is None else bool(preload)) and T == 1 and nsplit == 8
    late = LATE_STORES if late_stores is None else bool(late_stores)
    # v6 needs v5's late write-backs: an explicit late_stores=False (v3's order, "fast-s17kda", bench @v3) runs the
    # cluster-barrier exchanges unless dsmem_tx=True asks for both, which is an error
    tx = (DSMEM_TX and late) if dsmem_tx is None else bool(dsmem_tx)
    if tx and not late:
        raise ValueError("dsmem_tx (v6) needs late_stores: it writes the conv windows after the last exchange")
    return (compile_key(heads, T, nsplit, lower_bound, eps, head_dim) + (("early_trigger",) if early_trigger else ())
            + (("preload",) if pre else ()) + (("late_stores",) if late else ()) + (("dsmem_tx",) if tx else ()))


def compile_keys(heads: int, batches: Iterable[int], Ts: Iterable[int] = (1,), lower_bound: float = -5.0,
                 eps: float = 1e-5, early_trigger: bool = False, head_min=_MODULE) -> list:
    """The kernels kda_conv_gate_step runs with its default options for these batches and T."""
    keys = []
    for T in Ts:
        for b in batches:
            k = kernel_key(heads, T, choose_nsplit(b, heads, head_min), lower_bound, eps, early_trigger=early_trigger)
            if k not in keys:
                keys.append(k)
    return keys


def warmup(heads: int, batches: Iterable[int], Ts: Iterable[int] = (1,), lower_bound: float = -5.0,
           eps: float = 1e-5, early_trigger: bool = False, head_min=_MODULE) -> list:
    """Compile every kernel a (heads, batch list, T list) config needs; call before graph capture."""
    keys = compile_keys(heads, batches, Ts, lower_bound, eps, early_trigger, head_min)
    for k in keys:
        _get_compiled(k)
    return keys


# ---------------------------------------------------------------------------- device code

# Traced helpers shared by the cluster build (_build) and the one-CTA-per-head build (_build_head): the per-request
# slot, the W_fb rows, the conv step and the decay gate are the same arithmetic in both, which is what makes the two
# builds' outputs the same bits.

def _request_slot(mSlots, b, nslots):
    """(is_pad, is_bad, valid, slot_w) of request b: slot_w is its slot as a 64-bit index (S * H * 128 * 128 exceeds
    2**31 elements at full width, S > 1365), 0 for a padded or bad slot (never dereferenced; keeps the address math
    in range)."""
    import cutlass
    from cutlass import Int32, Int64
    slot = mSlots[b]
    valid = (slot >= 0) & (slot < nslots)
    return slot < 0, slot >= nslots, valid, Int32(cutlass.select_(valid, slot, Int32(0))).to(Int64)


def _load_fb_rows(mWfb, mDtBias, row0, step, jv, rW, rDt):
    """W_fb rows row0 + step m (m < len(rDt)), this thread's 16-byte vector jv of each, and their dt_bias."""
    _, cute = import_cute()
    for m in range(cute.size(rDt)):
        wrow = row0 + step * m
        cute.autovec_copy(cute.local_tile(mWfb[wrow, None], (8,), (jv,)), rW[m, None])
        rDt[m] = mDtBias[wrow]


def _conv_step(cw, win, c, x):
    """Channel c's causal conv at the new input x (fp32): sum of the 4 taps over the window [t-3, t-2, t-1] and x;
    the window then moves on by one (x becomes its newest entry)."""
    u = cw[c, 0] * win[c, 0] + cw[c, 1] * win[c, 1] + cw[c, 2] * win[c, 2] + cw[c, 3] * x
    win[c, 0] = win[c, 1]
    win[c, 1] = win[c, 2]
    win[c, 2] = x
    return u


def _decay_alpha(fa, rw_row, dt, decay_rate, lower_bound, lanes):
    """alpha = exp(lower_bound * sigmoid(exp(A_log) * (f + dt_bias))) of one channel, f = bf16(f_a . W_fb row) with
    the row spread over ``lanes`` lanes (8 bf16 each), summed by a butterfly over them."""
    from cutlass import BFloat16, Float32
    _, cute = import_cute()
    part = (fa * rw_row.load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    f = cute.arch.warp_reduction_sum(part, threads_in_group=lanes).to(BFloat16).to(Float32)
    return cute.math.exp(Float32(lower_bound) * sigmoid(decay_rate * (f + dt)))


def _build(heads: int, head_dim: int, T: int, nsplit: int, lower_bound: float, eps: float, early_trigger: bool = False,
           preload: bool = False, late_stores: bool = False, dsmem_tx: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr
    from cutlass.cutlass_dsl import dsl_user_op
    from cutlass._mlir.dialects import llvm

    H, D, NS = heads, head_dim, nsplit
    P = H * D
    assert not (preload and T != 1), "preload is a T = 1 build"
    assert not (dsmem_tx and not late_stores), "v6 (mbarrier exchange) writes the conv windows after phase C"
    R = D // NS                 # value rows (and f channels) per CTA
    RW = R // WARPS             # value rows per warp
    NTH = 32 * WARPS
    FV = D // 8                 # 16-byte vectors per W_fb row
    FROWS = R * FV // NTH       # W_fb rows per thread (rows tid//FV + (NTH//FV)*m)
    OUT_IT = (T * R + NTH - 1) // NTH
    QSCALE = float(D) ** -0.5
    assert D == 128 and R % WARPS == 0 and R <= 32 and (R * FV) % NTH == 0 and NTH % R == 0
    assert 1 <= T <= MAX_T

    @cute.jit
    def write_conv_window(mConvState, valid, split, has_v, slot_w, cq, ck, cv_c, win):
        # split 0 writes the head's q/k windows (every CTA of the cluster reads them), CTA s its v channels
        if valid:
            if split == 0:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, cq, j] = win[0, j].to(BFloat16)
                    mConvState[slot_w, ck, j] = win[1, j].to(BFloat16)
            if has_v:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, cv_c, j] = win[2, j].to(BFloat16)

    @cute.jit
    def write_state_rows(mRecState, valid, slot_w, h, row0, lane, rS):
        if valid:
            for r in cutlass.range_constexpr(RW):
                g_row = cute.local_tile(mRecState[slot_w, h, row0 + r, None], (4,), (lane,))
                cute.autovec_copy(rS[r, None], g_row)

    @dsl_user_op
    def st_async_f32(smem_ptr, val, rank, mbar_ptr, *, loc=None, ip=None):
        # v6: st.async into peer CTA `rank` (never the executing CTA: PTX leaves that undefined) at the same smem
        # offset; the 4 bytes complete_tx on the peer's mbarrier at the same offset, so the receiver's mbarrier wait
        # publishes them (no cluster barrier, no gpu fence)
        addr = smem_ptr.toint(loc=loc, ip=ip)
        bar = mbar_ptr.toint(loc=loc, ip=ip)
        llvm.inline_asm(
            None,
            [Int32(addr).ir_value(loc=loc, ip=ip), Float32(val).ir_value(loc=loc, ip=ip),
             Int32(rank).ir_value(loc=loc, ip=ip), Int32(bar).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 ra, rb;\n\tmapa.shared::cluster.u32 ra, $0, $2;\n\tmapa.shared::cluster.u32 rb, $3, $2;"
            "\n\tst.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [ra], $1, [rb];\n\t}",
            "r,f,r,r,~{memory}", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @cute.jit
    def request_step(mProj, mConvState, mRecState, mY, b, slot_w, valid, is_pad, is_bad, rS, win, cw, rW, rDt,
                     decay_rate, onorm, sUq, sUk, sAl, sUv, sO, sRed, sBeta, tid, lane, warp, split, h, cq, ck, cv_c,
                     has_v, jv, fr, row0, mbar=None):
        """Request b of this CTA's (head h, value rows [row0 of warp 0, +R)), after the PDL wait: the state rows are
        in rS and the conv windows in win (both zero for a padded or bad slot). Phases A-C below, with the two
        cluster exchanges (v6: through the mbarriers at mbar, mbar + 1); writes the conv window, the state rows
        and y."""
        # ---------------- phase A: conv, beta, f -> alpha for all T tokens (state-independent)
        rFa = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
        if const_expr(preload):
            # v3 (the default, T = 1): everything this thread reads from proj, issued together right after the wait.
            # In v2's SASS the beta logit and the f_a vector load sat behind the conv sigmoids' division
            # branches, and the output gate's load came after the last cluster barrier: 3 more round trips.
            p_xq = mProj[b, cq]
            p_xk = mProj[b, ck]
            p_xv = mProj[b, cv_c]
            p_beta = mProj[b, 4 * P + D + h]
            cute.autovec_copy(cute.local_tile(mProj[b, None], (8,), (4 * P // 8 + jv,)), rFa)
            p_gate = mProj[b, 3 * P + h * D + split * R + tid % R]
        for t in cutlass.range_constexpr(T):
            row = b * T + t
            if const_expr(preload):
                xq = p_xq.to(Float32)
                xk = p_xk.to(Float32)
                xv = p_xv.to(Float32)
            else:
                xq = mProj[row, cq].to(Float32)
                xk = mProj[row, ck].to(Float32)
                xv = mProj[row, cv_c].to(Float32)
            uq = _conv_step(cw, win, 0, xq)
            uk = _conv_step(cw, win, 1, xk)
            uv = _conv_step(cw, win, 2, xv)
            sUq[t, tid] = uq * sigmoid(uq)
            sUk[t, tid] = uk * sigmoid(uk)
            if has_v:
                sUv[t, tid] = uv * sigmoid(uv)
            if tid == 0:
                if const_expr(preload):
                    sBeta[t] = sigmoid(p_beta.to(Float32))
                else:
                    sBeta[t] = sigmoid(mProj[row, 4 * P + D + h].to(Float32))
            # f[i] = bf16(sum_j f_a[j] W_fb[hD+i, j]); 16 lanes (one W_fb row) per reduction
            if const_expr(not preload):
                cute.autovec_copy(cute.local_tile(mProj[row, None], (8,), (4 * P // 8 + jv,)), rFa)
            fa = rFa.load().to(Float32)
            for m in cutlass.range_constexpr(FROWS):
                alpha = _decay_alpha(fa, rW[m, None], rDt[m], decay_rate, lower_bound, FV)
                ch = split * R + fr + (NTH // FV) * m
                if jv < NS:
                    if const_expr(dsmem_tx):
                        # st.async must target another CTA of the cluster (PTX: undefined for the executing CTA):
                        # this CTA's own channels are plain shared stores, ordered by the CTA barrier below
                        if jv == split:
                            sAl[t, ch] = alpha
                        else:
                            st_async_f32(sAl.iterator + (t * D + ch), alpha, jv, mbar)
                    else:
                        st_shared_cluster_f32(sAl.iterator + (t * D + ch), alpha, jv)

        # cluster barrier 1: alpha of all channels is in every CTA's smem; every CTA has consumed
        # its (old) q/k conv window, so split 0 may now overwrite it. Also orders sUq/sUk/sUv/sBeta.
        # v6: this CTA's mbarrier completes when the D x T alpha values have landed (complete_tx), which needs no
        # gpu-scope fence; the CTA barrier orders sUq/sUk/sUv/sBeta. (Every peer has consumed its conv window
        # before sending: v6 builds write the windows after phase C, late_stores.)
        if const_expr(dsmem_tx):
            cute.arch.mbarrier_wait(mbar, 0)
            cute.arch.barrier()
        else:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        if const_expr(not late_stores):
            write_conv_window(mConvState, valid, split, has_v, slot_w, cq, ck, cv_c, win)

        # ---------------- phase B: T sequential delta-rule steps on the register-resident rows
        rK = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        rQ = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        rA = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        for t in cutlass.range(T, unroll=1):
            cute.autovec_copy(cute.local_tile(sUk[t, None], (4,), (lane,)), rK)
            cute.autovec_copy(cute.local_tile(sUq[t, None], (4,), (lane,)), rQ)
            cute.autovec_copy(cute.local_tile(sAl[t, None], (4,), (lane,)), rA)
            beta = sBeta[t]
            kk = rK.load()
            qq = rQ.load()
            al = rA.load()
            ksq = cute.arch.warp_reduction_sum((kk * kk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            qsq = cute.arch.warp_reduction_sum((qq * qq).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            kn = kk * cute.math.rsqrt(ksq + Float32(1e-6))
            qn = qq * (cute.math.rsqrt(qsq + Float32(1e-6)) * Float32(QSCALE))
            for r in cutlass.range_constexpr(RW):
                s = rS[r, None].load() * al
                sk = cute.arch.warp_reduction_sum((s * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                e = sUv[t, warp * RW + r] - sk
                s = s + kn * (beta * e)
                rS[r, None].store(s)
                o = cute.arch.warp_reduction_sum((s * qn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                if lane == 0:
                    sO[t, warp * RW + r] = o

        if const_expr(not late_stores):
            write_state_rows(mRecState, valid, slot_w, h, row0, lane, rS)

        # ---------------- phase C: gated RMSNorm over the head's 128 rows (cluster reduction)
        cute.arch.barrier()
        for t in cutlass.range_constexpr(T):
            if warp == t % WARPS:
                ov = Float32(0.0)
                if lane < R:
                    ov = sO[t, lane]
                ss = cute.arch.warp_reduction_sum(ov * ov)
                if lane < NS:
                    if const_expr(dsmem_tx):
                        if lane == split:
                            sRed[t, split] = ss
                        else:
                            st_async_f32(sRed.iterator + (t * NS + split), ss, lane, mbar + 1)
                    else:
                        st_shared_cluster_f32(sRed.iterator + (t * NS + split), ss, lane)
        if const_expr(dsmem_tx):
            # every peer's partial has landed, so every peer has also finished reading its conv window and its
            # phase B: the write-backs below are safe, and no peer writes into this CTA's smem any more
            cute.arch.mbarrier_wait(mbar + 1, 0)
            cute.arch.barrier()                     # this CTA's own partial (a plain shared store)
        else:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        for it in cutlass.range_constexpr(OUT_IT):
            idx = tid + NTH * it
            if idx < T * R:
                t = idx // R
                r = idx % R
                tot = Float32(0.0)
                for p in cutlass.range_constexpr(NS):
                    tot = tot + sRed[t, p]
                rstd = cute.math.rsqrt(tot * Float32(1.0 / D) + Float32(eps))
                col = h * D + split * R + r
                if const_expr(preload):
                    gate = p_gate.to(Float32)          # T = 1: idx = tid < R, so col = 3P + hD + sR + tid
                else:
                    gate = mProj[b * T + t, 3 * P + col].to(Float32)
                yv = onorm * sO[t, r] * rstd * sigmoid(gate)
                if is_pad:
                    yv = Float32(0.0)
                if is_bad:
                    yv = Float32(float("nan"))
                mY[b * T + t, col] = yv.to(BFloat16)

        if const_expr(late_stores):
            # v5: the write-backs after the last cluster barrier. A cluster barrier's arrive has release semantics,
            # which sm_90 implements as MEMBAR.ALL.GPU: issued before it, these stores made every thread wait for
            # their GPU-wide completion there (ncu at rank16 b64: "membar" 3.45 of 16.2 stall cycles per issue).
            write_conv_window(mConvState, valid, split, has_v, slot_w, cq, ck, cv_c, win)
            write_state_rows(mRecState, valid, slot_w, h, row0, lane, rS)

    class KdaConvGateStep:
        @cute.jit
        def __call__(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                     mY, stream):
            nb = cute.size(mSlots, mode=[0])
            self.kernel(mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                        mY).launch(grid=[NS, H, nb], block=[NTH, 1, 1], cluster=[NS, 1, 1],
                                   stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots, mY):
            tid, _, _ = cute.arch.thread_idx()
            _, h, b = cute.arch.block_idx()
            split = cute.arch.block_idx_in_cluster()          # == blockIdx.x (cluster spans x)
            lane = tid % 32
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            nslots = cute.size(mRecState, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sUq = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUk = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sAl = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUv = smem.allocate_tensor(Float32, cute.make_layout((T, R), stride=(R, 1)), 16)
            sO = smem.allocate_tensor(Float32, cute.make_layout((T, R), stride=(R, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((T, NS), stride=(NS, 1)), 16)
            sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,), stride=(1,)), 16)
            mbar = None
            if const_expr(dsmem_tx):
                # v6: one single-use mbarrier per exchange; each expects the bytes its CTA receives from its NS - 1
                # peers (alpha: (D - R) x T floats, the other CTAs' f channels; the norm: (NS - 1) x T partials).
                # One arrival (thread 0's expect_tx) plus the peers' complete_tx complete phase 0. Initialised before
                # the cluster arrive below, which the peers wait on before their first st.async (fence.mbarrier_init
                # orders the init for them).
                mbar = smem.allocate_array(Int64, 2)
                if tid == 0:
                    cute.arch.mbarrier_init(mbar, 1)
                    cute.arch.mbarrier_init(mbar + 1, 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, (D - R) * T * 4)
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + 1, (NS - 1) * T * 4)

            # DSMEM may only be written once every CTA of the cluster is running: arrive now, wait
            # just before the first remote store (the wait is normally already satisfied).
            cute.arch.cluster_arrive_relaxed()

            # ---------------- before the PDL wait: nothing here is produced by the previous kernel
            is_pad, is_bad, valid, slot_w = _request_slot(mSlots, b, nslots)

            # recurrent state rows of this warp: S[slot, h, v, 4*lane : 4*lane+4]
            row0 = split * R + warp * RW
            rS = cute.make_rmem_tensor(cute.make_layout((RW, 4), stride=(4, 1)), Float32)
            rS.fill(0.0)
            if valid:
                for r in cutlass.range_constexpr(RW):
                    g_row = cute.local_tile(mRecState[slot_w, h, row0 + r, None], (4,), (lane,))
                    cute.autovec_copy(g_row, rS[r, None])

            # conv taps: thread tid owns q channel hD+tid, k channel P+hD+tid, and (tid < R) the v
            # channel 2P+hD+sR+tid. win[c, j]: j = 0 oldest (t-3) ... 2 newest (t-1).
            cq = h * D + tid
            ck = P + h * D + tid
            cv = 2 * P + h * D + split * R + tid
            has_v = tid < R
            cv_c = cv
            if not has_v:
                cv_c = 2 * P + h * D + split * R
            win = cute.make_rmem_tensor(cute.make_layout((3, 3), stride=(3, 1)), Float32)
            win.fill(0.0)
            if valid:
                for j in cutlass.range_constexpr(3):
                    win[0, j] = mConvState[slot_w, cq, j].to(Float32)
                    win[1, j] = mConvState[slot_w, ck, j].to(Float32)
                    win[2, j] = mConvState[slot_w, cv_c, j].to(Float32)
            cw = cute.make_rmem_tensor(cute.make_layout((3, 4), stride=(4, 1)), Float32)
            cute.autovec_copy(mConvW[cq, None], cw[0, None])
            cute.autovec_copy(mConvW[ck, None], cw[1, None])
            cute.autovec_copy(mConvW[cv_c, None], cw[2, None])

            # W_fb rows for the f channels [sR, sR+R) of head h; thread: vector jv, rows fr + 8m
            jv = tid % FV
            fr = tid // FV
            rW = cute.make_rmem_tensor(cute.make_layout((FROWS, 8), stride=(8, 1)), BFloat16)
            rDt = cute.make_rmem_tensor(cute.make_layout((FROWS,), stride=(1,)), Float32)
            _load_fb_rows(mWfb, mDtBias, h * D + split * R + fr, NTH // FV, jv, rW, rDt)
            decay_rate = cute.math.exp(mALog[h])
            onorm = mONorm[split * R + tid % R]

            cute.arch.griddepcontrol_wait()
            cute.arch.cluster_wait()
            if const_expr(early_trigger):
                # v2 (opt-in, see the contracts): the dependent (o_proj + AttnRes #2) may start its weight stream now
                cute.arch.griddepcontrol_launch_dependents()

            request_step(mProj, mConvState, mRecState, mY, b, slot_w, valid, is_pad, is_bad, rS, win, cw, rW, rDt,
                         decay_rate, onorm, sUq, sUk, sAl, sUv, sO, sRed, sBeta, tid, lane, warp, split, h, cq, ck, cv_c,
                         has_v, jv, fr, row0, mbar)

            # state writes must be visible before a dependent grid may start its pre-wait loads. v5: with the early
            # trigger the dependents were launched before these writes, so the fence would order nothing for them
            # (later kernels see the writes through the grid's completion) and only wait for the stores to drain
            if const_expr(not (late_stores and early_trigger)):
                cute.arch.fence_acq_rel_gpu()
            if const_expr(not early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

    return KdaConvGateStep()


# ---------------------------------------------------------------------------- v9: one CTA per (request, head)
# The large-batch build (nsplit 1, version log v9): the state of a (request, head) staged whole in shared memory by
# bulk copies issued before the PDL wait, and everything of the head computed once, in one CTA of 8 warps.

def head_smem_bytes(T: int, head_dim: int = HEAD_DIM) -> int:
    """Shared memory of one v9 CTA: the state, five [T, D] fp32 vectors, the norm partials, beta, the chunks'
    mbarriers (and alignment)."""
    return head_dim * head_dim * 4 + 5 * T * head_dim * 4 + T * 4 * 4 + 16 + 16 + 8 * HEAD_CHUNKS + 128


def head_min_blocks(T: int) -> int:
    """Resident v9 CTAs per SM asked of ptxas (its register cap: 65536 / (blocks x 256 threads)): as many as the
    shared memory holds (228 KB per SM, 1 KB of it reserved per CTA) up to 3 at T = 1 (80 registers, no spills;
    ptxas 12.9) and 2 above (at 80 registers the unrolled T-token phase A spills 180 bytes at T = 4)."""
    return min(3 if T == 1 else 2, (228 * 1024) // (head_smem_bytes(T) + 1024))


def _head_occupancy(T: int) -> dict:
    # the carveout is given explicitly: without it the DSL asks the driver at compile time, which a CPU compile
    # cannot (router_down_topk._occupancy_hint)
    return {"min_blocks_per_mp": head_min_blocks(T), "preferred_smem_carveout": 100}


def _build_head(heads: int, head_dim: int, T: int, lower_bound: float, eps: float, early_trigger: bool = False,
                row_group: int = 1, proj_first: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import (cp_async_bulk_commit_group,
                                                              cp_async_bulk_global_shared_cta,
                                                              cp_async_bulk_shared_cluster_global,
                                                              cp_async_bulk_wait_group)

    H, D = heads, head_dim
    P = H * D
    NTH = 32 * HEAD_WARPS
    RW = D // HEAD_WARPS        # state rows per warp (16)
    FV = D // 8                 # 16-byte vectors per W_fb row
    FSTEP = NTH // FV           # W_fb rows between a thread's rows (16)
    FROWS = D // FSTEP          # W_fb rows per thread (8)
    OUT_IT = (T * D + NTH - 1) // NTH
    QSCALE = float(D) ** -0.5
    # the gated norm's sum of o^2 as nsplit 4 forms it: 4 warp sums over rows [32p, 32p + 32), added in p order, so
    # that y equals the nsplit 4 build's bit for bit (every other value is computed per row / channel as there)
    NPART = 4
    PROWS = D // NPART
    RG = row_group              # state rows a warp loads before updating them (HEAD_ROW_GROUP)
    CHUNK_ROWS = D // HEAD_CHUNKS
    CHUNK_BYTES = CHUNK_ROWS * D * 4
    WPC = HEAD_WARPS // HEAD_CHUNKS    # warps per chunk (their rows are the chunk's)
    assert D == 128 and NTH == 2 * D and PROWS == 32 and NPART <= HEAD_WARPS and 1 <= T <= MAX_T and RW % RG == 0
    assert HEAD_WARPS % HEAD_CHUNKS == 0 and CHUNK_ROWS == RW * WPC and HEAD_CHUNKS <= 15

    @cute.jit
    def row_vec(t2, row, lane):
        """Lane's 4 keys (16 bytes) of row `row` of a [rows, D] fp32 tensor (shared memory)."""
        return cute.local_tile(t2[row, None], (4,), (lane,))

    class KdaHeadStep:
        @cute.jit
        def __call__(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                     mY, stream):
            nb = cute.size(mSlots, mode=[0])
            self.kernel(mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                        mY).launch(grid=[1, H, nb], block=[NTH, 1, 1], stream=stream, use_pdl=True,
                                   **_head_occupancy(T))

        @cute.kernel
        def kernel(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots, mY):
            tid, _, _ = cute.arch.thread_idx()
            _, h, b = cute.arch.block_idx()
            lane = tid % 32
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            nslots = cute.size(mRecState, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sS = smem.allocate_tensor(Float32, cute.make_layout((D, D), stride=(D, 1)), 128)
            sUq = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUk = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUv = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sAl = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sO = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((T, NPART), stride=(NPART, 1)), 16)
            sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,), stride=(1,)), 16)
            mbar = smem.allocate_array(Int64, HEAD_CHUNKS)

            # ---------------- before the PDL wait: nothing here is produced by the previous kernel
            is_pad, is_bad, valid, slot_w = _request_slot(mSlots, b, nslots)

            # conv channels: threads [0, D) own the q channel hD + tid and the k channel P + hD + tid, threads
            # [D, 2D) the v channel 2P + hD + tid - D. win[c, j]: j = 0 oldest (t-3) ... 2 newest (t-1).
            is_qk = tid < D
            c0 = 2 * P + h * D + tid - D
            if is_qk:
                c0 = h * D + tid
            c1 = P + h * D + tid % D
            win = cute.make_rmem_tensor(cute.make_layout((2, 3), stride=(3, 1)), Float32)
            win.fill(0.0)
            if valid:
                for j in cutlass.range_constexpr(3):
                    win[0, j] = mConvState[slot_w, c0, j].to(Float32)
                    if is_qk:
                        win[1, j] = mConvState[slot_w, c1, j].to(Float32)
            cw = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), Float32)
            cute.autovec_copy(mConvW[c0, None], cw[0, None])
            cute.autovec_copy(mConvW[c1, None], cw[1, None])

            # W_fb rows fr + FSTEP m of head h (every channel of the head), 16-byte vector jv of each
            jv = tid % FV
            fr = tid // FV
            rW = cute.make_rmem_tensor(cute.make_layout((FROWS, 8), stride=(8, 1)), BFloat16)
            rDt = cute.make_rmem_tensor(cute.make_layout((FROWS,), stride=(1,)), Float32)
            _load_fb_rows(mWfb, mDtBias, h * D + fr, FSTEP, jv, rW, rDt)
            decay_rate = cute.math.exp(mALog[h])
            onorm = mONorm[tid % D]         # output element idx = tid + NTH it has row idx % D = tid % D

            # the head's 64 KB of state: HEAD_CHUNKS bulk copies of CHUNK_ROWS rows, each on its own mbarrier, so
            # that the warps of chunk c start as soon as it lands (v9.1). Issued after this thread's small loads
            # above: the conv windows and W_fb rows are what phase A waits for, and behind 25 MB of bulk traffic
            # (rank16 b64) they came back only with the last of it (s70: 34 % of the stall samples there). v9.2
            # (proj_first) issues them later still, after the first token's projection loads (phase A below)
            if tid == 0:
                for c in cutlass.range_constexpr(HEAD_CHUNKS):
                    cute.arch.mbarrier_init(mbar + c, 1)
                cute.arch.mbarrier_init_fence()
                if const_expr(not proj_first):
                    if valid:
                        self.load_state(mRecState, sS, mbar, slot_w, h)
            if not valid:
                # a padded or bad request runs on a zero state, as the nsplit 4 / 8 builds do (its y rows are then
                # replaced by zeros / NaN; nothing is written back)
                for i in cutlass.range_constexpr(D * D // (4 * NTH)):
                    v4 = row_vec(sS, (tid + NTH * i) // 32, (tid + NTH * i) % 32)
                    v4.fill(0.0)

            cute.arch.griddepcontrol_wait()
            if const_expr(early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

            # ---------------- phase A: conv, beta, f -> alpha for all T tokens (state-independent)
            rFa = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
            p_gate = Float32(0.0)
            if const_expr(T == 1):
                p_gate = mProj[b, 3 * P + h * D + tid % D].to(Float32)     # loaded with the rest of the row
            for t in cutlass.range_constexpr(T):
                row = b * T + t
                x0 = mProj[row, c0].to(Float32)
                x1 = mProj[row, c1].to(Float32)
                cute.autovec_copy(cute.local_tile(mProj[row, None], (8,), (4 * P // 8 + jv,)), rFa)
                if const_expr(proj_first and t == 0):
                    # v9.2: the first token's projections are requested before the state's 64 KB, so that phase
                    # A's inputs do not queue behind 25 MB of bulk copies (rank16 b64); the CTA barrier makes every
                    # warp's requests precede thread 0's copies
                    cute.arch.barrier()
                    if tid == 0:
                        if valid:
                            self.load_state(mRecState, sS, mbar, slot_w, h)
                u0 = _conv_step(cw, win, 0, x0)
                u1 = _conv_step(cw, win, 1, x1)
                if is_qk:
                    sUq[t, tid] = u0 * sigmoid(u0)
                    sUk[t, tid] = u1 * sigmoid(u1)
                else:
                    sUv[t, tid - D] = u0 * sigmoid(u0)
                if tid == 0:
                    sBeta[t] = sigmoid(mProj[row, 4 * P + D + h].to(Float32))
                # f[i] = bf16(sum_j f_a[j] W_fb[hD+i, j]); 16 lanes (one W_fb row) per reduction, as in nsplit 4 / 8
                fa = rFa.load().to(Float32)
                for m in cutlass.range_constexpr(FROWS):
                    alpha = _decay_alpha(fa, rW[m, None], rDt[m], decay_rate, lower_bound, FV)
                    if jv == 0:
                        sAl[t, fr + FSTEP * m] = alpha
            cute.arch.barrier()
            chunk = warp // WPC             # the chunk of this warp's rows
            if valid:
                cute.arch.mbarrier_wait(mbar + chunk, 0)

            # ---------------- phase B: T sequential delta-rule steps on the rows in shared memory
            rK = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rQ = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rA = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rS = cute.make_rmem_tensor(cute.make_layout((RG, 4), stride=(4, 1)), Float32)
            for t in cutlass.range(T, unroll=1):
                cute.autovec_copy(row_vec(sUk, t, lane), rK)
                cute.autovec_copy(row_vec(sUq, t, lane), rQ)
                cute.autovec_copy(row_vec(sAl, t, lane), rA)
                beta = sBeta[t]
                kk = rK.load()
                qq = rQ.load()
                al = rA.load()
                ksq = cute.arch.warp_reduction_sum((kk * kk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                qsq = cute.arch.warp_reduction_sum((qq * qq).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                kn = kk * cute.math.rsqrt(ksq + Float32(1e-6))
                qn = qq * (cute.math.rsqrt(qsq + Float32(1e-6)) * Float32(QSCALE))
                # RG rows at a time (load RG, update each, store RG): the rows are independent, so RG > 1 gives the
                # scheduler RG reduction chains to interleave; RG = 1 holds one row (4 registers) at a time
                for g in cutlass.range_constexpr(RW // RG):
                    for r in cutlass.range_constexpr(RG):
                        cute.autovec_copy(row_vec(sS, warp * RW + g * RG + r, lane), rS[r, None])
                    for r in cutlass.range_constexpr(RG):
                        row = warp * RW + g * RG + r
                        s = rS[r, None].load() * al
                        sk = cute.arch.warp_reduction_sum((s * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                        e = sUv[t, row] - sk
                        s = s + kn * (beta * e)
                        rS[r, None].store(s)
                        o = cute.arch.warp_reduction_sum((s * qn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                        if lane == 0:
                            sO[t, row] = o
                    for r in cutlass.range_constexpr(RG):
                        cute.autovec_copy(rS[r, None], row_vec(sS, warp * RW + g * RG + r, lane))

            # a chunk leaves as soon as its WPC warps are done with it: their generic-proxy writes to shared memory
            # are made visible to the bulk-copy (async) proxy, a named barrier of those warps, then the chunk's
            # first lane hands the rows to the bulk engine
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1 + chunk, number_of_threads=32 * WPC)
            is_storer = (warp % WPC == 0) & (lane == 0)
            if is_storer:
                if valid:
                    cp_async_bulk_global_shared_cta(mRecState[slot_w, h, chunk * CHUNK_ROWS, None].iterator,
                                                    sS[chunk * CHUNK_ROWS, None].iterator, CHUNK_BYTES)
                    cp_async_bulk_commit_group()
            cute.arch.barrier()             # sO complete for the norm

            # ---------------- phase C: gated RMSNorm over the head's 128 rows
            for i in cutlass.range_constexpr(T * NPART):
                if warp == i % HEAD_WARPS:
                    ov = sO[i // NPART, (i % NPART) * PROWS + lane]
                    ss = cute.arch.warp_reduction_sum(ov * ov)
                    if lane == 0:
                        sRed[i // NPART, i % NPART] = ss
            cute.arch.barrier()
            for it in cutlass.range_constexpr(OUT_IT):
                idx = tid + NTH * it
                if idx < T * D:
                    t = idx // D
                    r = idx % D
                    tot = Float32(0.0)
                    for p in cutlass.range_constexpr(NPART):
                        tot = tot + sRed[t, p]
                    rstd = cute.math.rsqrt(tot * Float32(1.0 / D) + Float32(eps))
                    gate = p_gate
                    if const_expr(T > 1):
                        gate = mProj[b * T + t, 3 * P + h * D + r].to(Float32)
                    yv = onorm * sO[t, r] * rstd * sigmoid(gate)
                    if is_pad:
                        yv = Float32(0.0)
                    if is_bad:
                        yv = Float32(float("nan"))
                    mY[b * T + t, h * D + r] = yv.to(BFloat16)

            if valid:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, c0, j] = win[0, j].to(BFloat16)
                    if is_qk:
                        mConvState[slot_w, c1, j] = win[1, j].to(BFloat16)
            if is_storer:
                if valid:
                    if const_expr(early_trigger):
                        # the shared rows must outlive the bulk engine's reads of them; the dependents already run,
                        # and later kernels see the writes through this grid's completion
                        cp_async_bulk_wait_group(0, read=True)
                    else:
                        # a dependent launched at the end may read the state before its wait (a second KDA step):
                        # the writes must be complete and ordered before the trigger
                        cp_async_bulk_wait_group(0)
            if const_expr(not early_trigger):
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def load_state(self, mRecState, sS, mbar, slot_w, h):
            """The head's 64 KB of state into shared memory: HEAD_CHUNKS bulk copies, each completing on its own
            mbarrier (v9.1)."""
            for c in cutlass.range_constexpr(HEAD_CHUNKS):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + c, CHUNK_BYTES)
                cp_async_bulk_shared_cluster_global(sS[c * CHUNK_ROWS, None].iterator,
                                                    mRecState[slot_w, h, c * CHUNK_ROWS, None].iterator,
                                                    mbar + c, CHUNK_BYTES)

    return KdaHeadStep()


def _compile(key):
    _, heads, head_dim, T, nsplit, lower_bound, eps = key[:7]
    early = "early_trigger" in key[7:]
    preload = "preload" in key[7:]
    late = "late_stores" in key[7:]
    dsmem_tx = "dsmem_tx" in key[7:]
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    P = heads * head_dim
    M = cute.sym_int()          # B*T rows
    B = cute.sym_int()          # requests
    S = cute.sym_int()          # state slots
    if nsplit == 1:
        rg = next((int(f[4:]) for f in key[7:] if f.startswith("rows")), 1)
        obj = _build_head(heads, head_dim, T, lower_bound, eps, early_trigger=early, row_group=rg,
                          proj_first="proj_first" in key[7:])
    else:
        obj = _build(heads, head_dim, T, nsplit, lower_bound, eps, early_trigger=early, preload=preload,
                     late_stores=late, dsmem_tx=dsmem_tx)
    fakes = (
        fake_tensor(BFloat16, (M, proj_width(heads, head_dim))),
        fake_tensor(BFloat16, (P, head_dim)),
        fake_tensor(Float32, (3 * P, 4)),
        fake_tensor(Float32, (heads,), align=4),
        fake_tensor(Float32, (P,)),
        fake_tensor(Float32, (head_dim,)),
        fake_tensor(BFloat16, (S, 3 * P, 3), align=2),
        fake_tensor(Float32, (S, heads, head_dim, head_dim)),
        fake_tensor(Int32, (B,), align=4),
        fake_tensor(BFloat16, (M, P)),
    )
    return cute.compile(obj, *fakes, fake_stream(), options=TVM_FFI)


def _get_compiled(key):
    return compile_cached(key, lambda: _compile(key))


# ---------------------------------------------------------------------------- host entry point

def kda_conv_gate_step(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, *, heads,
                       head_dim=128, T=1, lower_bound=-5.0, eps=1e-5, out=None, nsplit=None, early_trigger=False,
                       preload=None, late_stores=None, dsmem_tx=None, row_group=None, proj_first=None):
    """One fused KDA decode step (T tokens per request). Updates conv_state and rec_state in place
    for the valid slots and returns y [B*T, H*D] bf16. See the module docstring for the contracts.

    early_trigger (v2, opt-in): launch the PDL dependents right after the wait instead of at the end. Only for a
    dependent that reads no KDA state before its own wait (o_proj in the layer chain), never for a second KDA step
    launched directly behind this one.

    preload (v3; None = PRELOAD, on by default): at T = 1, every proj value is loaded right after the wait (bit-identical).
    Ignored for T > 1, where the per-token loads would cost T times the registers, and for nsplit 4 (it spills).

    late_stores (v5; None = LATE_STORES, on by default): the conv-window and state write-backs come after the last
    cluster barrier, and with early_trigger there is no fence at the end (bit-identical results).

    dsmem_tx (v6; None = DSMEM_TX, off by default): the alpha and norm exchanges through st.async + mbarrier
    complete_tx instead of cluster barriers (bit-identical results). Needs late_stores.

    row_group (v9, nsplit 1 only; None = HEAD_ROW_GROUP): state rows a warp loads from shared memory before updating
    them (bit-identical for every value).

    proj_first (v9.2, nsplit 1 only; None = HEAD_PROJ_FIRST): the first token's projections are requested after the
    PDL wait and before the state's bulk copies, which then leave after the wait (bit-identical)."""
    import torch

    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM}, got {head_dim}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if not isinstance(T, int) or not (1 <= T <= MAX_T):
        raise ValueError(f"T must be an int in 1..{MAX_T}, got {T!r}")
    if not (-5.0 <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
    D, H = head_dim, heads
    P = H * D
    # dtypes and shapes first (these run on CPU too), then one device for everything
    check_tensor("slots", slots, dtype=torch.int32, align=4)
    if slots.dim() != 1:
        raise ValueError(f"slots: expected shape [B], got {list(slots.shape)}")
    B = slots.shape[0]
    ns = choose_nsplit(B, H) if nsplit is None else int(nsplit)
    if ns not in NSPLITS:
        raise ValueError(f"nsplit must be one of {NSPLITS} (1: one CTA per request and head), got {nsplit}")
    key = kernel_key(H, T, ns, lower_bound, eps, D, early_trigger=early_trigger, preload=preload,
                     late_stores=late_stores, dsmem_tx=dsmem_tx, row_group=row_group,
                     proj_first=proj_first)     # the options' errors come before the tensors'
    check_tensor("proj", proj, dtype=torch.bfloat16, shape=(B * T, proj_width(H, D)))
    check_tensor("w_fb", w_fb, dtype=torch.bfloat16, shape=(P, D))
    check_tensor("conv_w", conv_w, dtype=torch.float32, shape=(3 * P, 4))
    check_tensor("a_log", a_log, dtype=torch.float32, shape=(H,), align=4)
    check_tensor("dt_bias", dt_bias, dtype=torch.float32, shape=(P,))
    check_tensor("o_norm", o_norm, dtype=torch.float32, shape=(D,))
    check_tensor("conv_state", conv_state, dtype=torch.bfloat16, shape=(None, 3 * P, 3), align=2)
    check_tensor("rec_state", rec_state, dtype=torch.float32, shape=(None, H, D, D))
    if conv_state.shape[0] != rec_state.shape[0]:
        raise ValueError(f"conv_state and rec_state must have the same number of slots, got "
                         f"{conv_state.shape[0]} and {rec_state.shape[0]}")
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(B * T, P))
    dev = slots.device
    if dev.type != "cuda":
        raise ValueError(f"kda_conv_gate_step needs CUDA tensors, got slots on {dev}")
    for name, t in (("proj", proj), ("w_fb", w_fb), ("conv_w", conv_w), ("a_log", a_log), ("dt_bias", dt_bias),
                    ("o_norm", o_norm), ("conv_state", conv_state), ("rec_state", rec_state), ("out", out)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of slots), got {t.device}")
    if out is None:
        out = torch.empty((B * T, P), dtype=torch.bfloat16, device=dev)
    if B == 0:
        return out
    _get_compiled(key)(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, out)
    return out
