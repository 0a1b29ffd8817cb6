#!/usr/bin/env bash
# The GPU machine's side of scripts/device/prepare.sh (this project's staging, not a user step; prepare.sh copies this
# file to .device/stage.sh). `bash .device/stage.sh N` keeps part N; `bash .device/stage.sh install` joins the parts,
# installs them under /tmp/k3site and writes /tmp/k3env.sh (source it before python3). Install may run twice on
# one machine: after the base parts, then after the vLLM parts.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
mkdir -p /tmp/k3stage
case "${1:-}" in
  [0-9]*) cp "$here/$1"/*part.* /tmp/k3stage/ && echo "part $1 kept ($(du -sh /tmp/k3stage | cut -f1) so far)" ;;
  install)
    # each tar series that arrived since the last install: the base (part.*), vLLM (vpart.*)
    cd /tmp/k3stage
    for p in part vpart; do ! ls $p.* > /dev/null 2>&1 || { cat $p.* | tar xf - && rm -f $p.*; }; done
    mkdir -p /tmp/k3site opt
    # optional-*.whl: installed apart, into /tmp/k3hum, put on the path only by the runs that ask for them
    for f in optional-*.whl; do [ -e "$f" ] && mv "$f" "opt/${f#optional-}"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/k3site ./*.whl 2>&1 | grep -v WARNING || true
    if ls opt/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/k3hum opt/*.whl 2>&1 | grep -v WARNING || true
      rm -rf opt
    fi
    [ ! -f vllm-0.33.0-pruned.tar.xz ] || tar xJf vllm-0.33.0-pruned.tar.xz -C /tmp/k3site
    rm -f ./*.whl vllm-0.33.0-pruned.tar.xz
    # A --target install does not run the cutlass .pth file: put dsl_packages on the path by hand. nsight-python
    # 0.9 imports ncu_report, which Nsight Compute ships in its extras/python folder beside the ncu binary.
    ncupy=""
    if command -v ncu > /dev/null; then
      d=$(dirname "$(readlink -f "$(command -v ncu)")")
      for c in "$d/extras/python" "$(dirname "$d")/extras/python"; do [ -f "$c/ncu_report.py" ] && ncupy=":$c" && break; done
    fi
    # ncu may be a wrapper script outside its install folder (e.g. /usr/local/cuda/bin/ncu): look where CUDA and
    # Nsight Compute install themselves
    if [ -z "$ncupy" ]; then
      c=$(find /usr/local /opt -maxdepth 6 -name ncu_report.py -path '*extras/python*' 2>/dev/null | sort | tail -1)
      [ -z "$c" ] || ncupy=":$(dirname "$c")"
    fi
    printf 'export PYTHONPATH=%s:/tmp/k3site:/tmp/k3site/nvidia_cutlass_dsl/dsl_packages%s${PYTHONPATH:+:$PYTHONPATH}\nexport PYTHONUNBUFFERED=1\n' "$root" "$ncupy" > /tmp/k3env.sh
    . /tmp/k3env.sh
    python3 -c "import cutlass, tvm_ffi, fla, torch; print('ready: cutlass', cutlass.__version__, 'tvm_ffi', tvm_ffi.__version__, 'fla', fla.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
    [ ! -d /tmp/k3site/nsight ] || python3 -c "import nsight, importlib.metadata as m; print('ready: nsight-python', m.version('nsight-python'))" 2>&1 | tail -1 || true
    [ ! -d /tmp/k3site/vllm ] || python3 -c "import vllm; print('ready: vllm', vllm.__version__)" 2>&1 | tail -1 ;;
  *) echo "usage: stage.sh N | install"; exit 2 ;;
esac
