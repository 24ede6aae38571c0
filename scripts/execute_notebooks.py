"""Execute chapter notebooks in place, so they are committed with their outputs.

The book never re-executes a notebook (``execute_notebooks: "off"`` in ``_config.yml``):
what a reader sees is what the last run recorded. This script is that run. On a machine
with a CUDA GPU the outputs are GPU outputs; on a CPU they are CPU outputs.

    python scripts/execute_notebooks.py                      # every notebooks/NN_*.ipynb
    python scripts/execute_notebooks.py notebooks/02_attention.ipynb
    python scripts/execute_notebooks.py --timeout 900 notebooks/1*.ipynb

Each notebook runs top to bottom in a fresh kernel with the notebook's folder as the
working directory. A notebook that raises is left unchanged on disk and the script exits
non-zero after trying the rest. The wall time of each notebook is printed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent


def merge_streams(outputs: list) -> list:
    merged = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if out.output_type == "stream" and prev is not None and prev.output_type == "stream" and prev.name == out.name:
            prev.text += out.text
        else:
            merged.append(out)
    return merged


def execute(path: Path, timeout: int, kernel: str) -> float:
    """Run one notebook and write it back with its outputs; return the wall time in seconds."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    # Outputs only: drop the per-cell execution timestamps so a re-run diffs cleanly, and
    # join the pieces of a stream that the kernel happened to flush separately.
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = merge_streams(cell.outputs)
    nbformat.write(nb, path)
    return seconds


def shown(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: notebooks/[0-9]*.ipynb)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    args = parser.parse_args()

    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
    if not paths:
        print("no notebooks found", file=sys.stderr)
        return 1
    failed = []
    for path in paths:
        path = path.resolve()
        try:
            seconds = execute(path, args.timeout, args.kernel)
        except CellExecutionError as e:
            failed.append(path)
            print(f"FAILED  {shown(path)}\n{e}", file=sys.stderr)
            continue
        print(f"{seconds:7.1f} s  {shown(path)}", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(shown(p) for p in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
