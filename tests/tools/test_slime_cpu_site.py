"""tools/slime_cpu_site.sh finds Megatron-LM's patched training tree without GitHub: CI
reaches only PyPI, no package there ships ``megatron.training``, so the checkout carries the
tree slime's image has (third_party/megatron-lm-1dcf0da.tar.xz) and the script unpacks it once
beside the site."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = ROOT / "third_party" / "megatron-lm-1dcf0da.tar.xz"


def _find_tree(here: Path, site: Path) -> subprocess.CompletedProcess:
    """The script's own find_tree function, run with HERE / SITE set as the script sets them."""
    script = (ROOT / "tools" / "slime_cpu_site.sh").read_text()
    start = script.index("find_tree() {")
    body = script[start:script.index("\n}\n", start) + 3]
    cmd = (f"set -euo pipefail; unset MEGATRON_TRAINING_SRC; HERE={here}; SITE={site}; "
           f"TREE_NAME=megatron-lm-1dcf0da\n{body}\nfind_tree")
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)


def test_the_carried_tree_is_found_and_unpacked_once_beside_the_site(tmp_path):
    here = tmp_path / "checkout"
    (here / "third_party").mkdir(parents=True)
    shutil.copy(ARCHIVE, here / "third_party")
    site = tmp_path / "cache" / "slime-cpu-site"
    r = _find_tree(here, site)
    assert r.returncode == 0, r.stderr
    tree = Path(r.stdout.strip())
    assert tree == tmp_path / "cache" / "megatron-lm-1dcf0da"
    assert (tree / "megatron" / "training" / "arguments.py").is_file()
    assert not (tree / "megatron" / "__init__.py").exists()  # joins megatron.core's namespace
    assert "1dcf0dafa884ad52ffb243625717a3471643e087" in (tree / "PROVENANCE.md").read_text()
    stamp = (tree / "megatron" / "training" / "arguments.py").stat().st_mtime_ns
    assert Path(_find_tree(here, site).stdout.strip()) == tree
    assert (tree / "megatron" / "training" / "arguments.py").stat().st_mtime_ns == stamp


def test_carries_slimes_megatron_patches():
    """slime's `megatron.patch` passes the post-attention / post-MLP layer norms into the
    transformer config (upstream 1dcf0da's arguments.py has neither line)."""
    r = subprocess.run(["tar", "xJOf", str(ARCHIVE), "megatron/training/arguments.py"],
                       capture_output=True, text=True, check=True)
    assert "def parse_args" in r.stdout
    assert "kw_args['post_self_attn_layernorm'] = args.post_self_attn_layernorm" in r.stdout


def test_no_tree_anywhere_prints_nothing(tmp_path):
    r = _find_tree(tmp_path / "bare", tmp_path / "cache" / "site")
    assert r.returncode == 0 and r.stdout.strip() == ""
