"""Print one of the README's two commands, read from its "Two commands" section, so that .ci/run
runs exactly what the README shows (python3 only, no third-party imports: it runs before any
install):

    python3 scripts/readme_commands.py main   # installs and runs `cppo train` (the main job)
    python3 scripts/readme_commands.py test   # installs and runs the tests
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Two commands"


def readme_commands(text: str) -> dict[str, str]:
    """{'main': ..., 'test': ...}: the first two bash blocks of the "Two commands" section, each
    one line; anything else is a SystemExit naming what was expected."""
    if SECTION not in text:
        raise SystemExit(f"README.md has no {SECTION!r} section")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    if len(blocks) != 2 or any("\n" in block for block in blocks):
        raise SystemExit(f"README.md's {SECTION!r} section must hold two one-line bash blocks, "
                         f"the main job and the tests; found {len(blocks)}: {blocks}")
    main, test = blocks
    if not main.endswith("cppo train") or "pytest" not in test:
        raise SystemExit(f"README.md's first command must end with `cppo train` and the second "
                         f"run pytest: {blocks}")
    return {"main": main, "test": test}


if __name__ == "__main__":
    if sys.argv[1:] not in (["main"], ["test"]):
        raise SystemExit(__doc__)
    print(readme_commands(README.read_text())[sys.argv[1]])
