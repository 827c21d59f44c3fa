"""A virtual environment over this one, for a package that pins its own versions of others
(verifiers pins openai and mcp; a TRL comparison its own trl):

    python -m launch.venv .venv-vf        # then: .venv-vf/bin/pip install verifiers==0.4.0 uv

It sees every package of the environment that runs this command (torch, transformers,
switchyard), whether that environment is itself a virtualenv or not, and what is installed into
it comes first. `python -m venv --system-site-packages` cannot do this from inside a virtualenv:
it links the base interpreter's packages, not the virtualenv's (so `import torch` fails there).
Here the new environment has no system packages of its own; a `.pth` file adds this one's
site directories after its own (`site.addsitedir`, so their `.pth` files, an editable switchyard
install's among them, are read too).
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

PTH = "_switchyard_overlay.pth"


def site_dirs() -> list[str]:
    """This interpreter's site directories (a virtualenv's own and, when it includes them, the base's)."""
    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    out: list[str] = []
    for d in dirs:
        if Path(d).is_dir() and d not in out:
            out.append(d)
    return out


def overlay_venv(path: str | Path) -> Path:
    """Make (or refresh) a virtualenv at `path` over this environment; its python."""
    path = Path(path).absolute()
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs())
    (Path(purelib) / PTH).write_text(lines)
    return python


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__)
        return 2
    python = overlay_venv(args[0])
    print(f"{python}: a virtualenv over {sys.prefix} ({', '.join(site_dirs())}); install into it with "
          f"{python.parent / 'pip'} install -c <(echo torch==VERSION) PACKAGE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
