"""Write the serve configs into the RayService manifests' ``serveConfigV2`` (ops/kuberay/, docs/deploy.md).

    python ops/kuberay/sync_serve_config.py            # rewrite the manifests' serveConfigV2 blocks
    python ops/kuberay/sync_serve_config.py --check    # exit 1 naming each manifest that is out of date

``rayservice-gpu.yaml`` carries serve_config.gpu.yaml and ``rayservice-cpu.yaml`` serve_config.yaml, each
without its leading comment and listening on 0.0.0.0 (serve_config.yaml's 127.0.0.1 would not do: in a pod,
Serve's proxy must be reachable from the Kubernetes Service). Only the ``serveConfigV2: |`` block changes: the rest
of each manifest, comments included, stays as written. tests/test_deploy.py fails while a manifest is
out of date. Plain text handling, no YAML library: this runs with any Python 3.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# manifest -> the serve config it carries
MANIFESTS: dict[str, str] = {"rayservice-gpu.yaml": "serve_config.gpu.yaml", "rayservice-cpu.yaml": "serve_config.yaml"}
POD_HOST = "0.0.0.0"  # http_options.host in a pod
_KEY = re.compile(r"^(?P<indent> *)serveConfigV2: \|\n", re.M)


def serve_config_text(serve_text: str, host: str = POD_HOST) -> str:
    """The serve config as it goes into a pod: its leading comment dropped, ``http_options.host`` set."""
    lines = serve_text.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    text, n = re.subn(r"^(http_options:\n(?:[ \t]+.*\n)*?[ \t]+host:[ \t]*)\S+", rf"\g<1>{host}",
                      "\n".join(lines) + "\n", count=1, flags=re.M)
    if n != 1:
        raise ValueError("the serve config has no http_options.host to set")
    return text


def render(manifest_text: str, serve_text: str) -> str:
    """``manifest_text`` with its ``serveConfigV2: |`` block replaced by ``serve_text``, indented under it."""
    m = _KEY.search(manifest_text)
    if m is None:
        raise ValueError("the manifest has no `serveConfigV2: |` block")
    indent = len(m.group("indent")) + 2
    rest = manifest_text[m.end():].splitlines(keepends=True)
    n = 0  # the old block: its blank lines and those indented deeper than the key
    while n < len(rest) and (not rest[n].strip() or len(rest[n]) - len(rest[n].lstrip(" ")) >= indent):
        n += 1
    while n and not rest[n - 1].strip():  # blank lines after the block belong to what follows
        n -= 1
    block = "".join(" " * indent + line if line.strip() else "\n" for line in serve_text.splitlines(keepends=True))
    return manifest_text[:m.end()] + block + "".join(rest[n:])


def expected(manifest: str) -> str:
    """The manifest's text with its serve config as the repository's serve config file has it now."""
    return render((HERE / manifest).read_text(), serve_config_text((ROOT / MANIFESTS[manifest]).read_text()))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for manifest, config in MANIFESTS.items():
        want = expected(manifest)
        if (HERE / manifest).read_text() != want:
            stale.append(f"ops/kuberay/{manifest} (from {config})")
            if not check:
                (HERE / manifest).write_text(want)
    if stale:
        verb = "out of date" if check else "rewritten"
        print(f"{verb}: " + ", ".join(stale) + ("; run python ops/kuberay/sync_serve_config.py" if check else ""))
    return 1 if stale and check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
