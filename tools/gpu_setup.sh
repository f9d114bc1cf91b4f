# Shared steps of the device scripts (tools/gpu_serving_run.sh, tools/gpu_quant_ab.sh, tools/gpu_vision_tests.sh),
# sourced from the checkout's root: install the carried wheels and this checkout, and build the test tokenizer (no
# network on the device).

# install_checkout [DIR]: the wheels carried in DIR (default .gpu-wheels, tools/gpu_wheels.sh), then this
# checkout's five distributions, editable.
install_checkout() {
    local wheels="${1:-.gpu-wheels}"
    python3 -m pip install -q --no-index --no-cache-dir --find-links "$wheels" -r "$wheels/requirements.txt" \
        || return 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e ./ninfer-core -e ./ninfer-qwen3_5 \
        -e ./ninfer-qwen4exp -e ./ninfer-convert -e ./ninfer-serve
}

# make_tokenizer PATH: the Qwen3.5 tokenizer.json the tests build (tests/frontend/conftest.py), written to PATH.
make_tokenizer() {
    python3 - tests/frontend/conftest.py "$1" <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.spec_from_file_location("frontend_conftest", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._build_tokenizer_json(pathlib.Path(sys.argv[2]))
PY
}
