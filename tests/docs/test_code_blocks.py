"""Every code block of the documentation pages runs, or is marked as not run with its reason (code_blocks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from code_blocks import ROOT, page_blocks, pages

BLOCKS = [block for page in pages() for block in page_blocks(page)]

#: a page of blocks that must fail, run beside the documentation's in the same process
BROKEN = """# Broken

```python
value = 6 * 7
```

```python
assert value == 42
print(undefined_name)
```

```bash
lightning fit --config configs/classification/quickstart.yaml --trainer.max_epochz 3
```

```bash
lightning fit --config configs/classification/quickstart.yaml --print_config
pip install polyattn-lightning
```

```yaml
unmarked: true
```

<!-- not run: -->
```python
pass
```
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Each run block's outcome: every page, and :data:`BROKEN`, in one process (about a minute on 2 cores)."""
    folder = tmp_path_factory.mktemp("code_blocks")
    broken = folder / "broken.md"
    broken.write_text(BROKEN)
    results, log = folder / "results.json", folder / "runner.log"
    runs = sum(block.runs for block in BLOCKS)
    print(f"running the documentation's {runs} code blocks in one process (about a minute; log: {log})", flush=True)
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("code_blocks.py")), str(folder / "work"), str(results),
             *map(str, pages()), str(broken)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    assert done.returncode == 0, log.read_text()[-4000:]
    return json.loads(results.read_text())


def test_every_block_is_run_or_marked():
    problems = [block.problem() for block in BLOCKS if block.problem()]
    ran = sum(block.runs for block in BLOCKS)
    print(f"documentation code blocks: {len(BLOCKS)}, {ran} run, {len(BLOCKS) - ran - len(problems)} marked not run")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", [block for block in BLOCKS if block.runs], ids=lambda block: block.id)
def test_the_block_runs(outcomes, block):
    assert block.id in outcomes, f"{block.id} did not run"
    assert outcomes[block.id]["ok"], f"{block.id} failed:\n{outcomes[block.id]['detail']}"


def test_the_runner_fails_on_a_broken_block(outcomes, tmp_path):
    """A page's blocks share a namespace; a failing Python line, an unknown CLI option and a command that is not
    the project's fail their blocks; an unmarked YAML block and a reason-less marker are refused, not run."""
    page = tmp_path / "broken.md"
    page.write_text(BROKEN)
    blocks = page_blocks(page)
    assert [(b.line, b.language, b.runs) for b in blocks] == [
        (3, "python", True), (7, "python", True), (12, "bash", True), (16, "bash", True), (21, "yaml", False),
        (26, "python", False),
    ]  # fmt: skip
    assert "a yaml block is neither run nor marked" in blocks[4].problem()
    assert "`not run:` needs a reason" in blocks[5].problem()
    broken = {int(key.rsplit(":", 1)[1]): result for key, result in outcomes.items() if "broken.md:" in key}
    assert sorted(broken) == [3, 7, 12, 16]
    assert broken[3]["ok"]
    assert not broken[7]["ok"] and "NameError: name 'undefined_name' is not defined" in broken[7]["detail"]
    assert not broken[12]["ok"] and "--trainer.max_epochz 3 --print_config` exited with 2" in broken[12]["detail"]
    assert "max_epochz" in broken[12]["detail"].split("exited with 2:", 1)[1]  # the CLI's own error line
    assert not broken[16]["ok"]
    assert "`pip install polyattn-lightning` is not a lightning/polyattn command" in broken[16]["detail"]
