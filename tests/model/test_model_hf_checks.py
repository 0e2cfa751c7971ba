"""The Hugging Face directory checks load no transformers: importing them, and refusing a bad config.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_PROBE = """
import sys
from pathlib import Path
import rlbus.model.policies.hf_checks as checks
loaded = 'transformers' in sys.modules
try:
    checks.check_dir(Path(sys.argv[1]))
except checks.PolicyError as err:
    print(err)
print('LOADED' if loaded or 'transformers' in sys.modules else 'CLEAN')
"""


def _probe(path: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def test_importing_the_checks_and_refusing_a_bad_config_leave_transformers_unloaded(tmp_path: Path) -> None:
    """`check_dir` refuses a config.json of an unsupported architecture, naming the file and key, in a process
    where neither importing hf_checks nor the refusal loaded transformers."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8,
                                                      "max_position_embeddings": 16}))
    *refusal, verdict = _probe(tmp_path)
    assert verdict == "CLEAN"
    assert refusal and f"{tmp_path / 'config.json'}: key 'architectures' is 'GPT2LMHeadModel'" in refusal[0]


def test_the_probe_sees_transformers_when_it_is_loaded(tmp_path: Path) -> None:
    """The same probe reports LOADED where the checked module loads transformers (so the test above can fail)."""
    code = _PROBE.replace("import rlbus.model.policies.hf_checks as checks",
                          "import transformers\nimport rlbus.model.policies.hf_checks as checks")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "LOADED"
