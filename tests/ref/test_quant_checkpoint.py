"""MXFP4 bit-exactness and checkpoint I/O."""
import pytest
import torch

from k3ref import K3DecoderLayer, Precision, random_layer, tiny
from k3ref.checkpoint import load_layer, load_tensors, save_layers
from k3ref.quant import dequant_mxfp4, e2m1_table, quantize_mxfp4, unpack_e2m1
from k3ref.weights import CheckpointError, layer_from_checkpoint, layer_to_checkpoint

pytestmark = pytest.mark.ref


def test_unpack_all_256_bytes_low_nibble_first():
    b = torch.arange(256, dtype=torch.uint8)
    v = unpack_e2m1(b[:, None])                          # [256, 2]
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for x in range(256):
        lo, hi = x & 0xF, x >> 4
        want = [(-1 if c & 8 else 1) * mags[c & 7] for c in (lo, hi)]
        assert v[x].tolist() == want, f"byte {x:#04x}"


def test_mxfp4_round_trip_exact_on_all_256_bytes():
    """packed bytes -> values -> quantize -> the same bytes (up to +-0, which has two codes)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 1).view(4, 128)        # every byte, 4 rows x 256 values
    scale = torch.full((4, 8), 127, dtype=torch.uint8)
    scale[:, 0] = 127 + 6                                       # make 6 the max of every block at scale 2^e
    vals = dequant_mxfp4(packed, scale, torch.float32)
    # re-quantising needs each block's max magnitude to be 6 * 2^(s-127): true when the block holds code 7/15
    p2, s2 = quantize_mxfp4(vals)
    back = dequant_mxfp4(p2, s2, torch.float32)
    assert torch.equal(back, vals)
    neg0 = packed ^ p2                                          # differences only where the value is +-0
    lo_diff, hi_diff = neg0 & 0xF, neg0 >> 4
    assert ((lo_diff == 0) | (lo_diff == 8)).all() and ((hi_diff == 0) | (hi_diff == 8)).all()


def test_dequant_is_exact_in_bf16():
    packed = torch.randint(0, 256, (8, 64), dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(100, 150, (8, 4), dtype=torch.int32).to(torch.uint8)
    assert torch.equal(dequant_mxfp4(packed, scale, torch.bfloat16).double(), dequant_mxfp4(packed, scale, torch.float64))


def test_checkpoint_round_trip_and_layer_runs(tmp_path):
    cfg = tiny()
    ws = [random_layer(cfg, l, seed=3) for l in (0, 1, 3)]
    path = str(tmp_path / "k3-tiny.safetensors")
    save_layers(path, ws, cfg)
    for w in ws:
        back = load_layer(path, cfg, w.layer)
        for (n, a), (_, b) in zip(w.tensors(), back.tensors()):
            assert torch.equal(a, b), n
        K3DecoderLayer(cfg, back, Precision.model())


def test_bad_checkpoint_lists_every_problem(tmp_path):
    cfg = tiny()
    t = layer_to_checkpoint(random_layer(cfg, 1), cfg)
    p = "language_model.model.layers.1."
    del t[p + "self_attn.q_proj.weight"]
    t[p + "self_attn.k_proj.weight"] = t[p + "self_attn.k_proj.weight"][:, :-1]
    t[p + "self_attn.A_log"] = t[p + "self_attn.A_log"].bfloat16()
    t[p + "block_sparse_moe.experts.3.w2.weight_packed"] = t[p + "block_sparse_moe.experts.3.w2.weight_packed"].float()
    t[p + "self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    with pytest.raises(CheckpointError) as e:
        layer_from_checkpoint(t, cfg, 1)
    msg = str(e.value)
    assert "5 problem(s)" in msg
    for s in ("missing: " + p + "self_attn.q_proj.weight", "wrong shape: " + p + "self_attn.k_proj.weight",
              "wrong dtype: " + p + "self_attn.A_log", "experts.3.w2.weight_packed", "unexpected: " + p + "self_attn.rotary_emb"):
        assert s in msg, s


def test_whole_model_round_trip_and_decode(tmp_path):
    """A small whole model (tiny) written with the release's names, read back, decoded twice."""
    from k3ref.checkpoint import load_model, save_model
    from k3ref.model import K3Model, random_model
    cfg = tiny()
    w = random_model(cfg, seed=2)
    path = str(tmp_path / "model.safetensors")
    save_model(path, w, cfg)
    back = load_model(path, cfg)
    m = K3Model(cfg, back, Precision.model(), slots=3, max_len=8)
    slots = torch.tensor([0, 2])
    logits1 = m.decode_step(torch.tensor([5, 17]), slots)
    logits2 = m.decode_step(logits1.argmax(-1), slots)
    assert logits2.shape == (2, cfg.vocab_size) and torch.isfinite(logits2).all()
    assert not torch.equal(logits1, logits2)
    t = load_tensors(path)
    del t["language_model.lm_head.weight"]
    from k3ref.model import model_from_checkpoint
    with pytest.raises(CheckpointError, match="missing: language_model.lm_head.weight"):
        model_from_checkpoint(t, cfg)


def test_random_mxfp4_codes_are_the_int32_draw_stored_as_bytes():
    """random_mxfp4 draws its packed codes as uint8 (no 4-byte transient): the values stay those of the int32 draw
    that earlier records' weights came from, and the scale draw after it still sees the same generator state."""
    from k3ref.weights import random_mxfp4
    g = torch.Generator().manual_seed(11)
    packed, scale = random_mxfp4((64, 128), 3, 0.05, g, "cpu")
    g = torch.Generator().manual_seed(11)
    want = torch.randint(0, 256, (3, 64, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    e0 = round(torch.log2(torch.tensor(0.05 / 2.93)).item())
    want_scale = (127 + e0 + torch.randint(-1, 2, (3, 64, 4), generator=g, dtype=torch.int32)).to(torch.uint8)
    assert torch.equal(packed, want) and torch.equal(scale, want_scale)
