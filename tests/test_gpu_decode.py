"""scripts/gpu_decode.py's logic on the CPU (its methods run on a lent GPU): the eager methods decode the
payload's prompts losslessly, and --profile brings back where each method's step goes."""

import importlib.util
import json
from pathlib import Path

from maverick.tokenizer import default_gguf_path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_decode.py"


def test_gpu_decode_runs_the_eager_methods_and_profiles_them(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    gd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gd)
    prompts = tmp_path / "prompts.json"
    assert gd.main(["--prepare", "--n", "1", "--prompts", str(prompts)]) == 0
    argv = ["--device", "cpu", "--gguf", str(default_gguf_path()), "--prompts", str(prompts), "--n", "1",
            "--max-new-tokens", "8", "--methods", "eager-plain,eager-eagle3", "--profile", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert gd.main(argv) == 0
    r = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert r["errors"] == {} and r["summary"]["eager-eagle3"]["mismatches_vs_eager-plain"] == 0
    for m in ("eager-plain", "eager-eagle3"):
        prof = r["profile"][m]
        assert prof["steps"] == 2 and prof["wall_ms"] > 0 and len(prof["ops"]) == 15
        assert "device_ms" not in prof  # a CPU run: the ops' CPU time only
