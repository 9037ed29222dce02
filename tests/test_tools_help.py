"""Every tool's --help prints: argparse formats help text only when asked, so a stray `%` in it (bench_gpu_verify's
`--attention` had one) crashes `--help` and nothing else shows it. One process runs them all (imports shared)."""
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"

RUNNER = r"""
import runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: returned without printing help")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{path}: exit {e.code}")
    except Exception as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
print("\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_tool_prints_its_help():
    tools = sorted(str(p) for p in TOOLS.glob("*.py") if "argparse" in p.read_text())
    assert len(tools) > 20
    run = subprocess.run([sys.executable, "-c", RUNNER, *tools], capture_output=True, text=True, timeout=600,
                         cwd=TOOLS.parent)
    assert run.returncode == 0, run.stderr[-4000:]
