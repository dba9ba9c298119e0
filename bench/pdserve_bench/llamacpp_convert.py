"""llama.cpp's own `convert_hf_to_gguf.py`, to turn a Hugging Face directory into the GGUF
file llama.cpp would make of it: the tests check that pdserve reads each family's GGUF
names, metadata and layouts as llama.cpp's converter writes them, not as we think it does.

The converter ships in llama-cpp-python's source distribution (with llama.cpp's `gguf-py`,
newer than the `gguf` wheel pdserve pins). `fetch()` downloads that sdist from PyPI once
(`make setup` does) and keeps only the converter's files in pdserve's cache:

    .venv/bin/python -m pdserve_bench.llamacpp_convert fetch
    .venv/bin/python -m pdserve_bench.llamacpp_convert HF_DIR OUT.gguf [--outtype f32]

Tiny test models have tokenizers of their own making; the converter names a byte-level
BPE vocabulary's pre-tokenizer by hashing how a known model's tokenizer splits a text, and
refuses one it does not know. `convert(..., bpe_pre="qwen2")` names it instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
"""llama-cpp-python's version, whose vendored llama.cpp converts (the one bench/llamacpp
builds too)."""
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"
HOME = CACHE / f"llama.cpp-convert-{VERSION}"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

_RUNNER = """
import runpy, sys
home, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [home, home + "/gguf-py"]
if pre:
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [home + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def fetch() -> Path:
    """The converter's directory, downloaded and unpacked on first use."""
    if (HOME / "convert_hf_to_gguf.py").is_file():
        return HOME
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", tmp],
            check=True,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        partial = HOME.with_suffix(".partial")
        with tarfile.open(sdist) as tar:
            members = [
                m for m in tar.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_KEEP)
            ]  # fmt: skip
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(partial, members=members, filter="data")
        partial.rename(HOME)
    return HOME


def convert(hf_dir: Path, out: Path, outtype: str = "f32", bpe_pre: str | None = None) -> Path:
    """Convert `hf_dir` to the GGUF file `out` with llama.cpp's converter."""
    home = fetch()
    cmd = [sys.executable, "-c", _RUNNER, str(home), bpe_pre or "", str(hf_dir),
           "--outfile", str(out), "--outtype", outtype]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="a Hugging Face directory, or `fetch` to download only")
    p.add_argument("out", nargs="?", type=Path)
    p.add_argument("--outtype", default="f32")
    p.add_argument("--bpe-pre", default=None)
    args = p.parse_args()
    if args.hf_dir == "fetch":
        print(fetch())
        return
    if args.out is None:
        p.error("OUT is required")
    print(convert(Path(args.hf_dir), args.out, args.outtype, args.bpe_pre))


if __name__ == "__main__":
    main()
