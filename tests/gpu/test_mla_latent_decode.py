"""The split-KV latent decode attention (k3fast.kernels.mla_latent_decode) against an fp32 attention over the same
paged cache, at the head counts of k3_rank16 / k3_rank8 / full width, mixed request lengths (0 = padding, 1, page
edges, long), pages scattered through a NaN-poisoned pool, split and unsplit plans, CUDA-graph replays (GPU)."""
import pytest
import torch

from tolerances import assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast.kernels import mla_latent_decode as mk  # noqa: E402

SCALE = 192 ** -0.5


def paged_case(lengths, heads, *, seed, extra_pages=3):
    """q [N, H, 576], a pool whose unused pages and rows past each length are NaN, a block table that scatters
    each request's pages through the pool, and the lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = len(lengths)
    need = [-(-L // mk.PAGE) for L in lengths]
    maxp = max(max(need), 1)
    n_pages = sum(need) + extra_pages
    pool = torch.full((n_pages, mk.PAGE, mk.DQK), float("nan"), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(n_pages, generator=g, device="cuda").to(torch.int32)
    table = torch.full((N, maxp), n_pages - 1, dtype=torch.int32, device="cuda")
    used = 0
    for n, L in enumerate(lengths):
        for p in range(need[n]):
            page = perm[used]
            used += 1
            table[n, p] = page
            rows = min(mk.PAGE, L - p * mk.PAGE)
            pool[page, :rows] = torch.randn(rows, mk.DQK, generator=g, device="cuda").to(torch.bfloat16)
    q = (torch.randn(N, heads, mk.DQK, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return q, pool, table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def reference(q, pool, table, lengths):
    """fp32 attention over each request's rows, in token order; zeros for a request of length 0."""
    out = torch.zeros(q.shape[0], q.shape[1], mk.DV, dtype=torch.float32, device="cuda")
    for n, L in enumerate(lengths.tolist()):
        if L == 0:
            continue
        pages = table[n, :-(-L // mk.PAGE)].long()
        rows = pool[pages].reshape(-1, mk.DQK)[:L].float()
        p = torch.softmax((q[n].float() @ rows.T) * SCALE, dim=-1)
        out[n] = p @ rows[:, :mk.DV]
    return out


def check_o_lat(out, again, q, pool, table, lens):
    """o_lat of the live requests within bf16_kernel of fp32 attention, padded requests' rows zero, and a second
    call on the same inputs the same bits (the combine is deterministic)."""
    want = reference(q, pool, table, lens)
    live = lens > 0
    assert_close("o_lat", out[live].float(), want[live], "bf16_kernel")
    assert torch.equal(out[~live], torch.zeros_like(out[~live])), "a padded request's output is not zero"
    assert torch.equal(out, again), "two calls on the same inputs differ (the combine must be deterministic)"


LENGTH_SETS = {
    "b1-short": [1], "b1-page-edge": [64], "b1-8k": [8192], "b1-odd": [1000],
    "b3-mixed": [65, 1, 130], "b8-mixed": [8, 64, 63, 0, 257, 1, 512, 700],
    "b17-mixed": [(37 * i) % 300 for i in range(17)], "b64-1k": [1024 - 7 * i for i in range(64)],
}


@pytest.mark.parametrize("heads", [6, 12, 16, 96])
@pytest.mark.parametrize("case", list(LENGTH_SETS))
@pytest.mark.parametrize("nsm", [132, 8])
def test_against_fp32_attention(case, heads, nsm):
    """o within bf16_kernel of fp32 attention over the same rows; NaN rows past a length and NaN pages nobody
    references never leak; padded requests get zeros; the same call twice gives the same bits. Split counts planned
    for 132 SMs and for 8 (other S and pages per split, one split without a combine at batch 8, the same kernel)."""
    if heads == 96 and case in ("b64-1k", "b17-mixed"):
        pytest.skip("full width is covered at b1 / b3 / b8 (the 96-head plan reads each cache 6 times)")
    if nsm == 8 and heads in (12, 16):
        pytest.skip("the 8-SM plan's split counts are covered at 6 and 96 heads")
    lengths = LENGTH_SETS[case]
    q, pool, table, lens = paged_case(lengths, heads, seed=len(lengths) * 100 + heads)
    ws = mk.make_workspace(len(lengths), heads, table.shape[1], q.device, nsm=nsm)
    out = torch.full((len(lengths), heads, mk.DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, out=out, workspace=ws, nsm=nsm)
    again = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, workspace=ws, nsm=nsm)
    torch.cuda.synchronize()
    check_o_lat(out, again, q, pool, table, lens)


def test_graph_replay_with_new_lengths_and_pages():
    """Captured once (after a warm call), replayed with new lengths and a new block table: each replay equals the
    reference, so the combine's counters re-arm themselves and nothing is fixed at capture but the shapes."""
    from k3fast.measure.trace import capture
    heads, N = 6, 8
    q, pool, table, lens = paged_case([512] * N, heads, seed=7, extra_pages=8)
    ws = mk.make_workspace(N, heads, table.shape[1], q.device)
    out = torch.empty(N, heads, mk.DV, dtype=torch.bfloat16, device="cuda")
    g = capture(lambda: mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, out=out, workspace=ws))
    gen = torch.Generator(device="cpu").manual_seed(3)
    for step in range(3):
        new = torch.randint(0, 513, (N,), generator=gen).to(torch.int32)
        lens.copy_(new)
        table.copy_(table[torch.randperm(N, generator=gen)])
        g.replay()
        torch.cuda.synchronize()
        want = reference(q, pool, table, lens)
        live = lens > 0
        assert_close(f"replay {step}", out[live].float(), want[live], "bf16_kernel")


@pytest.mark.parametrize("heads", [6, 12])
@pytest.mark.parametrize("lengths", [[1], [64], [65, 0, 130, 1], [700 - 37 * i for i in range(17)]],
                         ids=["1", "64", "mixed", "b17"])
def test_fused_append_writes_the_row_once_and_attends_over_it(lengths, heads):
    """With the projection output given, row L - 1 of each live request is [RMSNorm_{kv_norm}(c~_kv) | k_pe] (within
    a bf16 ulp of torch's), written into its page only (every other pool row bit-identical, padded requests write
    nothing), and the output equals the attention over the pool with that row in place."""
    q, pool, table, lens = paged_case(lengths, heads, seed=900 + heads)
    N = len(lengths)
    g = torch.Generator(device="cuda").manual_seed(5)
    proj = torch.randn(N, 2880, generator=g, device="cuda").to(torch.bfloat16)
    kv_norm = (1 + 0.05 * torch.randn(512, generator=g, device="cuda")).float()
    before = pool.clone()
    out = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, proj=proj, proj_col=1536, kv_norm=kv_norm)
    torch.cuda.synchronize()
    raw = proj[:, 1536:1536 + 576].float()
    ckv = raw[:, :512] * torch.rsqrt(raw[:, :512].pow(2).mean(-1, keepdim=True) + 1e-5) * kv_norm
    want_rows = torch.cat([ckv, raw[:, 512:]], dim=-1).to(torch.bfloat16)
    expect = before.clone()
    for n, L in enumerate(lengths):
        if L:
            page, row = table[n, (L - 1) // mk.PAGE].item(), (L - 1) % mk.PAGE
            assert_close(f"row of request {n}", pool[page, row].float(), want_rows[n].float(), "bf16_kernel")
            expect[page, row] = pool[page, row]
    assert torch.equal(pool.view(torch.int16), expect.view(torch.int16)), "a pool row other than the new ones changed"
    want = reference(q, pool, table, lens)
    live = lens > 0
    assert_close("o_lat", out[live].float(), want[live], "bf16_kernel")


def deferred_o_lat(q, pool, table, lens, heads, nsm=132):
    """o_lat through the deferred combine: mla_latent_decode(defer=True), then mla_uv_gate's combine build with
    one-hot W_UV rows (dims 128 c .. 128 c + 127 for c = 0..3) and a saturated gate, which returns the combined
    o_lat exactly (one product per output, a sigmoid of 1.0 in fp32)."""
    from k3fast.kernels.mla_uv_gate import mla_uv_gate
    N = len(lens)
    ws = mk.make_workspace(N, heads, table.shape[1], q.device, nsm=nsm, defer=True)
    parts = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, workspace=ws, nsm=nsm, defer=True)
    assert isinstance(parts, mk.LatentPartials)
    z = torch.full((N, heads * 128), 30.0, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(N, heads, mk.DV, dtype=torch.bfloat16, device="cuda")
    eye = torch.eye(mk.DV, dtype=torch.bfloat16, device="cuda")
    for c in range(mk.DV // 128):
        w = eye[128 * c:128 * (c + 1)].expand(heads, 128, mk.DV).contiguous()
        y = mla_uv_gate(parts, w, z, g_col=0)
        out[:, :, 128 * c:128 * (c + 1)] = y.view(N, heads, 128)
    return out, parts


@pytest.mark.parametrize("heads", [6, 12, 96])
@pytest.mark.parametrize("case", ["b1-short", "b1-page-edge", "b1-8k", "b1-odd", "b3-mixed", "b8-mixed", "b64-1k"])
def test_deferred_combine_against_fp32_attention(case, heads):
    """The deferred build (every split publishes its partial, a wave of splits: 128 one-page splits at batch 1 and
    8K tokens) combined by mla_uv_gate: o_lat within bf16_kernel of fp32 attention, padded requests zero, NaN rows
    and pages nobody references never leak, the same bits twice."""
    if heads == 96 and case == "b64-1k":
        pytest.skip("full width is covered at b1 / b3 / b8")
    lengths = LENGTH_SETS[case]
    q, pool, table, lens = paged_case(lengths, heads, seed=len(lengths) * 31 + heads)
    out, parts = deferred_o_lat(q, pool, table, lens, heads)
    again, _ = deferred_o_lat(q, pool, table, lens, heads)
    torch.cuda.synchronize()
    assert parts.splits == mk.plan_splits(len(lengths), heads, table.shape[1], defer=True)[0]
    check_o_lat(out, again, q, pool, table, lens)


def test_deferred_combine_equals_the_in_kernel_combine_at_equal_splits():
    """At batch 8 and 32K tokens both plans take 16 splits: the deferred combine (in mla_uv_gate) and the in-kernel
    one sum the same partials with the same weights in the same order, so o_lat has the same bits."""
    heads, N = 6, 8
    q, pool, table, lens = paged_case([32768 - 5 * i for i in range(N)], heads, seed=11)
    assert mk.plan_splits(N, heads, table.shape[1]) == mk.plan_splits(N, heads, table.shape[1], defer=True)
    inside = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE)
    deferred, _ = deferred_o_lat(q, pool, table, lens, heads)
    torch.cuda.synchronize()
    assert torch.equal(inside.view(torch.int16), deferred.view(torch.int16))


def test_deferred_graph_replay_with_new_lengths_and_pages():
    """The deferred pair captured once and replayed with new lengths and tables equals the reference each time."""
    from k3fast.kernels.mla_uv_gate import mla_uv_gate
    from k3fast.measure.trace import capture
    heads, N = 6, 2
    q, pool, table, lens = paged_case([4096] * N, heads, seed=8, extra_pages=8)
    ws = mk.make_workspace(N, heads, table.shape[1], q.device, defer=True)
    z = torch.full((N, heads * 128), 30.0, dtype=torch.bfloat16, device="cuda")
    w = torch.eye(mk.DV, dtype=torch.bfloat16, device="cuda")[:128].expand(heads, 128, mk.DV).contiguous()
    y = torch.empty(N, heads * 128, dtype=torch.bfloat16, device="cuda")

    def step():
        parts = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, workspace=ws, defer=True)
        mla_uv_gate(parts, w, z, g_col=0, out=y)
    step()
    g = capture(step)
    gen = torch.Generator(device="cpu").manual_seed(4)
    for i in range(3):
        lens.copy_(torch.randint(0, 4097, (N,), generator=gen).to(torch.int32))
        table.copy_(table[torch.randperm(N, generator=gen)])
        g.replay()
        torch.cuda.synchronize()
        want = reference(q, pool, table, lens)[:, :, :128]
        live = lens > 0
        assert_close(f"replay {i}", y.view(N, heads, 128)[live].float(), want[live], "bf16_kernel")
