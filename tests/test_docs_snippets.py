"""Every ```python block of ``README.md`` and ``docs/*.md`` runs as written.

Convention (write it in the docs as an HTML comment on the line before the block, blank lines
allowed in between; a page's reader never sees it):

- no marker: the block runs in one process. The unmarked blocks of a page run in order in one
  interpreter and share their names, as a reader goes down the page: a later block may use the
  ``model`` an earlier one built.
- ``<!-- snippet: fragment -->``: a piece of a larger program (it uses names it does not define,
  or needs a GPU, the network or a checkpoint). It is only compiled, so it must be valid Python.
- ``<!-- snippet: torchrun N -->``: a complete script for N processes, as
  ``torchrun --standalone --nproc-per-node N script.py`` runs it on CPU (gloo). The test sets the
  environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``) in N processes forked from one interpreter that has already
  imported torch and dtensor_moe, which saves N imports; ``tests/test_demo.py`` covers torchrun
  itself.

Every block runs in a fresh temporary directory with the repository on ``PYTHONPATH``, so files
it writes land there. Keep runnable blocks small (small dims, a few steps): the whole file runs
in about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->")
TORCHRUN = re.compile(r"torchrun (\d+)")
TIMEOUT_S = 120

# Unmarked blocks that cannot run as written, each to be marked ``fragment`` (or completed) in
# its page: (page, the block's first code line) -> why. They are only compiled, like fragments,
# and the rest of the page still runs. Keyed by content, so edits elsewhere in a page do not
# move them; an entry whose block got its marker simply matches nothing.
KNOWN_INCOMPLETE: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    line: int  # 1-based line of the first code line
    kind: str  # "run", "fragment", "torchrun" or "known" (KNOWN_INCOMPLETE, compiled only)
    nproc: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _marker(lines: list[str], fence: int) -> str:
    """The marker on the nearest non-blank line before the fence, or ``""``."""
    k = fence - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    match = MARKER.fullmatch(lines[k].strip()) if k >= 0 else None
    return match.group(1) if match else ""


def snippets(page: Path) -> list[Snippet]:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            marker = _marker(lines, i)
            torchrun = TORCHRUN.fullmatch(marker)
            if marker not in ("", "fragment") and torchrun is None:
                raise ValueError(
                    f"{page.relative_to(ROOT)}:{i}: unknown snippet marker {marker!r}; use "
                    "'fragment' or 'torchrun N'"
                )
            kind = "torchrun" if torchrun else ("fragment" if marker else "run")
            key = (str(page.relative_to(ROOT)), lines[i + 1].strip())
            if kind == "run" and key in KNOWN_INCOMPLETE:
                kind = "known"
            found.append(Snippet(str(page.relative_to(ROOT)), i + 2, kind,
                                 int(torchrun.group(1)) if torchrun else 1,
                                 "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


ALL = [s for page in PAGES for s in snippets(page)]

# Runs the blocks of one page in order in one namespace; names the block that fails.
# (Both runners are separate interpreters, so nothing a block does touches the test process.)
_RUNNER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"SNIPPET FAILED: {where}", file=sys.stderr)
        sys.exit(1)
"""


# Forks N ranks with torchrun's environment from one interpreter, after the imports.
_FORK_RUNNER = """
import multiprocessing as mp, os, socket, sys, traceback
import torch, torch.distributed, dtensor_moe

def rank_main(rank, nproc, port, path, where):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        exec(compile(open(path).read(), where, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"SNIPPET FAILED on rank {rank}: {where}", file=sys.stderr)
        sys.exit(1)

if __name__ == "__main__":
    path, where, nproc = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, nproc, port, path, where))
             for r in range(nproc)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:  # a rank that fails would leave the others waiting in a collective
        mp.connection.wait([p.sentinel for p in running])
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in running:
                p.kill()
            break
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    sys.exit(0 if all(c == 0 for c in codes) else f"rank exit codes {codes}")
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    """Run ``cmd`` in a session of its own, so a timeout ends its forked ranks too."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} ran past {TIMEOUT_S} s:\n{output[-6000:]}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{output[-6000:]}", pytrace=False)


def _pages_with_runnable_blocks() -> list[str]:
    return sorted({s.page for s in ALL if s.kind == "run"})


@pytest.mark.parametrize("page", _pages_with_runnable_blocks())
def test_page_blocks_run_in_order(page, tmp_path):
    blocks = [s for s in ALL if s.page == page and s.kind == "run"]
    script = tmp_path / "blocks.json"
    script.write_text(json.dumps([(b.where, b.code) for b in blocks]))
    _run([sys.executable, "-c", _RUNNER, str(script)], tmp_path,
         f"{page}: blocks at lines {[b.line for b in blocks]}")


def _torchrun_in_ci(s) -> bool:
    """CI leaves out docs/training.md's dense-plan script (the block that calls
    ``parallelize_dense``): tests/test_dense_plan.py::test_training_md_snippet_matches_one_process
    runs that block as written on 4 ranks, with sequence parallelism on and off, and checks it
    against one process. DTENSOR_MOE_FULL_MATRIX=1 runs it here too (its own ranks, a real
    ``init_process_group``)."""
    dense_plan = s.page == "docs/training.md" and "parallelize_dense(model" in s.code
    return not dense_plan or os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


@pytest.mark.parametrize("snippet",
                         [s for s in ALL if s.kind == "torchrun" and _torchrun_in_ci(s)],
                         ids=lambda s: s.where)
def test_torchrun_block_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    _run([sys.executable, "-c", _FORK_RUNNER, str(script), snippet.where, str(snippet.nproc)],
         tmp_path, f"{snippet.where} on {snippet.nproc} ranks")


def test_fragments_are_valid_python():
    errors = []
    for s in ALL:
        if s.kind in ("fragment", "known"):
            try:
                compile(s.code, s.where, "exec")
            except SyntaxError as e:
                errors.append(f"{s.where}: {e}")
    assert not errors, "\n".join(errors)


def test_markers_are_known_and_pages_have_blocks():
    """Parsing every page raised no unknown-marker error, and found the blocks this file is
    about (a parser that finds nothing would pass every other test)."""
    kinds = {s.kind for s in ALL}
    assert {"run", "fragment", "torchrun"} <= kinds, kinds
    assert any(s.page == "docs/training.md" and s.kind == "torchrun" for s in ALL)


# Note [Quoted demo output]: the pages quote what the demo prints. Its text must be what the
# demo prints now; its figures too, within what differs between CPUs: the parity differences
# (float rounding, below 1e-3) within a factor of 4, every other figure (imbalance, shares,
# tolerances, losses) exactly. Timings and throughput are not compared. The default demo runs
# here (about 25 s on 2 cores); the pipeline demo's quote is compared with
# DTENSOR_MOE_FULL_MATRIX=1 (about a minute).
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")
_QUOTED = ("parity:", "load balancing:", "loss:", "distributed run done")


def _figures_agree(quoted: str, printed: str) -> bool:
    if _NUMBER.sub("#", quoted) != _NUMBER.sub("#", printed):
        return False
    for q, p in zip(_NUMBER.findall(quoted), _NUMBER.findall(printed), strict=True):
        qf, pf = float(q.rstrip("%")), float(p.rstrip("%"))
        if qf < 1e-3 and pf < 1e-3 and "e" in q:
            if not (qf / 4 <= pf <= qf * 4):
                return False
        elif q != p:
            return False
    return True


def _quoted_lines(page: Path, starts: tuple[str, ...], marker: str) -> list[str]:
    """The lines of ``page``'s ```text blocks that hold ``marker`` and start with one of
    ``starts``."""
    blocks = re.findall(r"```text\n(.*?)```", page.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    return [line for b in found for line in b.splitlines() if line.startswith(starts)]


def _check_quotes(pages: list[Path], output: str, marker: str) -> None:
    printed = {line.split(":")[0].split(";")[0]: line for line in output.splitlines()
               if line.startswith(_QUOTED)}
    checked, wrong = 0, []
    for page in pages:
        for line in _quoted_lines(page, _QUOTED, marker):
            key = line.split(":")[0].split(";")[0]
            checked += 1
            if key not in printed or not _figures_agree(line, printed[key]):
                wrong.append(f"{page.relative_to(ROOT)} quotes\n  {line}\nthe demo prints\n  "
                             f"{printed.get(key)}")
    assert checked >= len(pages), f"no quoted demo output found in {pages}"
    assert not wrong, "\n".join(wrong)


def test_quoted_figures_helper():
    good = "parity: max |loss difference| 4.77e-07 (tolerance 1e-05) -> OK; by 17%"
    assert _figures_agree(good, good.replace("4.77e-07", "2.68e-07"))
    assert not _figures_agree(good, good.replace("4.77e-07", "4.77e-05"))
    assert not _figures_agree(good, good.replace("17%", "18%"))
    assert not _figures_agree(good, good.replace("-> OK", "-> FAILED"))


def _demo_output(args: list[str], tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "dtensor_moe.demo", *args, "--out",
                           str(tmp_path / "out")], cwd=tmp_path, env=_env(), text=True,
                          capture_output=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quoted_demo_output_is_printed(tmp_path):
    output = _demo_output([], tmp_path)
    _check_quotes([ROOT / "README.md", ROOT / "docs/quickstart.md"], output, "parity:")


if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1":  # the 8-process pipeline demo

    def test_quoted_pipeline_demo_output_is_printed(tmp_path):
        output = _demo_output(["--pp", "2", "--schedule", "1f1b"], tmp_path)
        _check_quotes([ROOT / "docs/pipeline.md"], output, "micro-batches per step")
