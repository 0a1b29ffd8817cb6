"""k3fast.gemv_splitk on CPU: the host-side K split, the shapes it serves, clear errors, and an sm_90a compile of
every key the K3 in_proj shapes need."""
import pytest
import torch

from k3fast import gemv_splitk as S
from k3fast import rms_gemv as R
from k3fast._dsl import dsl_available
from k3ref.config import k3, k3_rank

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def test_config_hand_checked():
    # rank16 in_proj: 26 row blocks of 128 rows; K/32 = 224 = 2^5 * 7; the first divisor giving >= 264 CTAs is 14
    assert S.config(3216, 7168, 64) == 14 and S.compile_key(3216, 7168, 64) == (64, 16)
    assert S.config(3216, 7168, 8) == 14
    # rank8: 50 row blocks, K split 7 -> 350 CTAs (32-step x tile: 33 KB at M = 16)
    assert S.config(6288, 7168, 16) == 7
    for N, K, MB in [(3216, 7168, 64), (6288, 7168, 64), (49376, 7168, 8), (7168, 768, 32)]:
        kg = S.config(N, K, MB)
        assert (K // 32) % kg == 0 and S.x_tile_bytes(MB, (K // 32) // kg) <= S.X_TILE_MAX


def test_applicable_keeps_partials_in_l2():
    assert S.applicable(3216, 7168, 64)
    assert not S.applicable(49376, 7168, 64)          # 14 x 64 x 49376 fp32 partials = 177 MB
    assert not S.applicable(3216, 7160, 8)            # K % 32
    assert not S.applicable(3216, 7168, 65)


def test_clear_errors():
    x = torch.zeros(8, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16 and K of 32"):
        S.gemv_splitk(x[:, :7160], torch.zeros(3216, 7160, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="M must be in 1..64"):
        S.gemv_splitk(torch.zeros(65, 7168, dtype=torch.bfloat16), torch.zeros(3216, 7168, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        S.gemv_splitk(x.float(), torch.zeros(3216, 7168, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        S.gemv_splitk(x, torch.zeros(3216, 7168, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="divide"):
        S.compile_key(3216, 7168, 8, kg=5)
    with pytest.raises(ValueError, match="mma must be"):
        R.gemv(x, torch.zeros(3216, 7168, dtype=torch.bfloat16), mma="v9")


@needs_dsl
@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["k3_rank16", "k3_rank8", "full"])
def test_compile_in_proj_keys(cfg):
    N, K = R.k3_gemv_shapes(cfg)["in_proj"]
    keys = {S.compile_key(N, K, M) for M in (8, 16, 32, 64) if S.applicable(N, K, M)}
    assert keys or cfg.tp == 1
    for MB, kcs in keys:
        assert S.get_kernel(MB, kcs) is not None
