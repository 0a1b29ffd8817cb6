"""KDA: the token loop is the specification; the chunked form and the state bookkeeping must match it."""
import pytest
import torch

from k3ref import Precision, tiny
from k3ref.kda import decay_gate, gated_delta_rule_chunked, gated_delta_rule_recurrent, short_conv
from k3ref.norms import l2_norm
from tolerances import assert_close

pytestmark = pytest.mark.ref


def _inputs(N, T, H, D, dtype, lam_scale):
    q = l2_norm(torch.randn(N, T, H, D, dtype=dtype)) * D ** -0.5
    k = l2_norm(torch.randn(N, T, H, D, dtype=dtype))
    v = torch.randn(N, T, H, D, dtype=dtype)
    # lam_scale moves the decay into different regimes: ~0 (no decay) .. -5 (the lower bound)
    lam = -lam_scale * torch.rand(N, T, H, D, dtype=dtype)
    beta = torch.rand(N, T, H, dtype=dtype)
    S0 = torch.randn(N, H, D, D, dtype=dtype) * 0.1
    return q, k, v, lam, beta, S0


@pytest.mark.parametrize("T,chunk,lam_scale", [(1, 16, 1.0), (7, 16, 0.05), (37, 16, 1.0), (40, 8, 5.0), (64, 64, 5.0)],
                         ids=lambda v: str(v))
def test_chunked_equals_token_loop_fp64(seed, T, chunk, lam_scale):
    q, k, v, lam, beta, S0 = _inputs(2, T, 3, 16, torch.float64, lam_scale)
    o_ref, S_ref = gated_delta_rule_recurrent(q, k, v, lam, beta, S0)
    o, S = gated_delta_rule_chunked(q, k, v, lam, beta, S0, chunk=chunk)
    assert_close("o", o, o_ref, "fp64_reformulation")
    assert_close("S", S, S_ref, "fp64_reformulation")


def test_chunked_equals_token_loop_fp32(seed):
    q, k, v, lam, beta, S0 = _inputs(2, 48, 2, 32, torch.float32, 1.0)
    o_ref, S_ref = gated_delta_rule_recurrent(q, k, v, lam, beta, S0)
    o, S = gated_delta_rule_chunked(q, k, v, lam, beta, S0, chunk=16)
    assert_close("o", o, o_ref, "fp32_reformulation")
    assert_close("S", S, S_ref, "fp32_reformulation")


def test_recurrence_matches_key_major_paper_form(seed):
    """S_t = (I - b k k^T) Diag(alpha) S_{t-1} + b k v^T, o = S_t^T q (key-major, section 7.2 step 7)."""
    q, k, v, lam, beta, S0 = _inputs(1, 5, 2, 8, torch.float64, 1.0)
    o_ref, S_ref = gated_delta_rule_recurrent(q, k, v, lam, beta, S0)
    S = S0.transpose(-1, -2).clone()                      # [N, H, K, V]
    outs = []
    I = torch.eye(8, dtype=torch.float64)
    for t in range(5):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        S = (I - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]) @ (torch.exp(lam[:, t])[..., :, None] * S) \
            + bt[..., None, None] * kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, q[:, t]))
    assert_close("o", torch.stack(outs, 1), o_ref, "fp64_reformulation")
    assert_close("S", S.transpose(-1, -2), S_ref, "fp64_reformulation")


def test_decay_gate_is_lower_bounded():
    f = torch.linspace(-8, 8, 101, dtype=torch.float64)[None, None, :].expand(1, 2, 101)
    lam = decay_gate(f, torch.tensor([0.0, 1.0], dtype=torch.float64), torch.zeros(2, 101, dtype=torch.float64), -5.0)
    assert (lam > -5).all() and (lam < 0).all()                  # the bound is never reached
    assert lam[0, 1, -1] < -4.99 and lam[0, 1, 0] > -1e-8         # sigmoid(e^1 * +-8) saturates at both ends


def test_short_conv_matches_explicit_sum(seed):
    N, T, C, K = 2, 5, 6, 4
    z = torch.randn(N, T, C, dtype=torch.float64)
    st = torch.randn(N, C, K - 1, dtype=torch.float64)
    w = torch.randn(C, K, dtype=torch.float64)
    u, new = short_conv(z, st, w, Precision.exact())
    hist = torch.cat([st.transpose(1, 2), z], dim=1)
    for t in range(T):
        want = torch.nn.functional.silu(sum(w[:, j] * hist[:, t + j] for j in range(K)))
        assert_close(f"u[{t}]", u[:, t], want, "fp64_reformulation")
    assert torch.equal(new, hist[:, -3:].transpose(1, 2))
