"""Bad input gets a clear error that says what was expected."""
import pytest
import torch

from k3ref import K3Config, K3DecoderLayer, Precision, ResidualStream, allocate_state, k3_rank, random_layer, tiny
from k3ref.quant import dequant_mxfp4

pytestmark = pytest.mark.ref
CFG = tiny()


def _setup(layer=1, N=2):
    P = Precision.model()
    L = K3DecoderLayer(CFG, random_layer(CFG, layer), P)
    st = allocate_state(CFG, layer, 4, max_len=8, P=P)
    s = ResidualStream.from_embeddings(torch.randn(N, CFG.hidden_size).bfloat16(), CFG.max_blocks)
    return L, st, s


@pytest.mark.parametrize("mutate,match", [
    (lambda s, st: (s.__setattr__("partial", s.partial[:, :-1]), None)[1], "partial must be"),
    (lambda s, st: (s.__setattr__("partial", s.partial.float()), None)[1], "must be torch.bfloat16"),
    (lambda s, st: (s.__setattr__("delta", torch.zeros(3, CFG.hidden_size).bfloat16()), None)[1], "delta must be"),
    (lambda s, st: (st.__setattr__("recurrent", st.recurrent.bfloat16()), None)[1], "recurrent state must be torch.float32"),
    (lambda s, st: (st.__setattr__("conv", st.conv[:, :-1]), None)[1], "conv state must be"),
])
def test_shape_and_dtype_errors(mutate, match):
    L, st, s = _setup()
    mutate(s, st)
    with pytest.raises(ValueError, match=match):
        L.decode_step(s, st, torch.tensor([0, 1]))


def test_out_of_range_and_duplicate_slots():
    L, st, s = _setup()
    with pytest.raises(ValueError, match="slot index 4 out of range"):
        L.decode_step(s, st, torch.tensor([0, 4]))
    L, st, s = _setup()
    with pytest.raises(ValueError, match="share a slot"):
        L.decode_step(s, st, torch.tensor([1, 1]))
    L, st, s = _setup()
    with pytest.raises(TypeError, match="slots must be a 1-D int32/int64"):
        L.decode_step(s, st, torch.tensor([0.0, 1.0]))


def test_wrong_state_kind_and_weights_kind():
    L, st, s = _setup(layer=1)
    mla_state = allocate_state(CFG, 3, 4, max_len=8)
    with pytest.raises(ValueError, match="must be a KDAState"):
        L.decode_step(s, mla_state, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="expected MLAWeights"):
        K3DecoderLayer(CFG, random_layer(CFG, 1).__class__(**{**random_layer(CFG, 1).__dict__, "layer": 3}))


def test_device_mismatch_is_reported():
    L, st, s = _setup()
    s.partial = s.partial.to("meta")
    with pytest.raises(ValueError, match="is on meta but the layer's weights are on cpu"):
        L.decode_step(s, st, torch.tensor([0, 1]))


def test_config_errors():
    with pytest.raises(ValueError, match="not divisible by tp=5"):
        K3Config(tp=5)
    with pytest.raises(ValueError, match="gate_lower_bound must lie in"):
        K3Config(gate_lower_bound=-6.0)
    with pytest.raises(ValueError, match="k3_rank supports"):
        k3_rank(3)
    with pytest.raises(ValueError, match="layer index 93 outside"):
        K3Config().is_kda_layer(93)


def test_mxfp4_errors():
    with pytest.raises(TypeError, match="must be uint8"):
        dequant_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be \\[..., 1\\]"):
        dequant_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
