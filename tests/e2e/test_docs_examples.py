"""Every Python example in README.md and docs/*.md runs, as a user would copy it.

Each ```python block runs in a fresh interpreter (its own temporary folder, a timeout), with:

* CPU adaptation on a machine without CUDA, and nothing else: the substitutions in
  ``CPU_SUBSTITUTIONS`` (``"cuda"`` -> ``"cpu"``, ``.cuda()`` -> ``.cpu()``). fp16 needs none:
  torch runs fp16 autocast and fp16 tensors on CPU.
* Stand-ins for the names an example leaves to the reader (``MyModel``, ``loader``, ``loss_fn``,
  ...: ``_docs_placeholders.PLACEHOLDERS``), given to the example only when it uses the name
  without defining it. Nothing else is predefined, so a missing import fails, first by the
  static check below and then when it runs.
* Markers, an HTML comment on the line before the fence (sparingly):
  ``<!-- continues: SECTION -->``: the block is a fragment that continues the first Python block
  under the ``## SECTION`` heading of the same file, and runs after it, in one program;
  ``<!-- not-runnable: REASON -->``: not run; the reason must be given.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _docs_placeholders import PLACEHOLDERS

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CPU_SUBSTITUTIONS = (('"cuda"', '"cpu"'), (".cuda()", ".cpu()"))
TIMEOUT_S = 300
MARK_KINDS = ("continues", "not-runnable")
# Marks for blocks in sections whose text is edited elsewhere, applied as if written before the
# block's fence: (file, section) -> mark. Move one into the markdown and drop it here.
PENDING_MARKS: dict[tuple[str, str], str] = {}
# The Lightning example names the device "cuda". Copied as written onto a machine without CUDA it
# must still run: fastamp.Scaler("cuda") warns and disables itself there, as torch's does.
AS_WRITTEN_ON_CPU = ("README.md", "Using fastamp with Lightning / Accelerate / HF Trainer", 0)
_MARK = re.compile(r"^<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->$")


@dataclass
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    section: str  # the enclosing "## " heading
    index: int  # among the Python blocks of that section
    code: str
    mark: tuple[str, str] | None  # (kind, argument)

    @property
    def id(self) -> str:
        words = re.sub(r"[^A-Za-z0-9]+", "-", self.section).strip("-")
        return f"{self.file}:{words}:{self.index}"


def _parse_mark(text: str):
    found = _MARK.match(text.strip())
    return (found.group(1), found.group(2) or "") if found else None


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, section, per_section, i = [], "", {}, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        fence = line.strip()
        if fence.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            if fence == "```python":
                before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark = _parse_mark(before) if before.strip().startswith("<!--") else None
                if mark is None:
                    pending = PENDING_MARKS.get((path.name if path.parent == ROOT else f"docs/{path.name}", section))
                    if pending is not None and per_section.get(section, 0) == 0:
                        mark = _parse_mark(f"<!-- {pending} -->")
                blocks.append(
                    Block(
                        file=str(path.relative_to(ROOT)),
                        line=i + 1,
                        section=section,
                        index=per_section.get(section, 0),
                        code="\n".join(lines[i + 1 : end]) + "\n",
                        mark=mark,
                    )
                )
                per_section[section] = per_section.get(section, 0) + 1
            i = end
        i += 1
    return blocks


BLOCKS = [b for path in DOC_FILES for b in _blocks(path)]


def _program(block: Block) -> str:
    """The block's code, after the blocks it continues."""
    parts, seen = [block.code], {block.id}
    while block.mark is not None and block.mark[0] == "continues":
        block = next(b for b in BLOCKS if b.file == block.file and b.section == block.mark[1] and b.index == 0)
        assert block.id not in seen, f"continuation cycle at {block.id}"
        seen.add(block.id)
        parts.insert(0, block.code)
    return "\n".join(parts)


def _free_names(code: str) -> set[str]:
    """Names the code reads but never binds (anywhere in it) and that are not builtins."""
    tree = ast.parse(code)
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def _script(block: Block, adapt: bool) -> str:
    code = _program(block)
    if adapt:
        for old, new in CPU_SUBSTITUTIONS:
            code = code.replace(old, new)
    names = sorted(_free_names(code))
    if not names:
        return code
    # the stand-ins come from a function: only they are bound, not the torch it imports
    prelude = f"from _docs_placeholders import make as _make\nglobals().update(_make({names!r}))\ndel _make\n"
    return prelude + code


def _run(block: Block, tmp_path: Path, adapt: bool) -> None:
    script = tmp_path / "example.py"
    script.write_text(_script(block, adapt))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # set for the test suite (conftest.py); a user has none
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent)])
    env["HF_HUB_OFFLINE"] = "1"  # the examples build their models; nothing is downloaded
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, (
        f"{block.file}:{block.line} ({block.section}) failed with exit code {done.returncode}\n"
        f"--- program ---\n{script.read_text()}\n--- stderr (last 4000 chars) ---\n{done.stderr[-4000:]}"
    )


def test_examples_are_found_and_marked_well():
    assert len(BLOCKS) >= 5, [b.id for b in BLOCKS]
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids)), ids
    for block in BLOCKS:
        if block.mark is None:
            continue
        kind, argument = block.mark
        where = f"{block.file}:{block.line}"
        assert kind in MARK_KINDS, f"{where}: unknown mark {kind!r}; expected one of {MARK_KINDS}"
        assert argument.strip(), f"{where}: mark {kind!r} needs its argument (a reason or a section)"
        if kind == "continues":
            assert any(b.file == block.file and b.section == argument for b in BLOCKS), (
                f"{where}: continues section {argument!r}, which has no Python block in {block.file}"
            )
    for (file, section), mark in PENDING_MARKS.items():
        target = [b for b in BLOCKS if b.file == file and b.section == section and b.index == 0]
        assert target, f"PENDING_MARKS: no Python block in {file} section {section!r}"
        assert target[0].mark == _parse_mark(f"<!-- {mark} -->")
    file, section, index = AS_WRITTEN_ON_CPU
    assert any(b.file == file and b.section == section and b.index == index for b in BLOCKS), AS_WRITTEN_ON_CPU


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if not (b.mark and b.mark[0] == "not-runnable")], ids=lambda b: b.id
)
def test_example_uses_only_what_it_imports_or_the_reader_supplies(block):
    unknown = _free_names(_program(block)) - set(PLACEHOLDERS)
    assert not unknown, (
        f"{block.file}:{block.line} ({block.section}) uses {sorted(unknown)} without importing or defining "
        f"it; the names left to the reader are {sorted(PLACEHOLDERS)}"
    )


def _cases():
    cuda = torch.cuda.is_available()
    for block in BLOCKS:
        if block.mark and block.mark[0] == "not-runnable":
            continue
        yield pytest.param(block, not cuda, id=block.id)
        if not cuda and (block.file, block.section, block.index) == AS_WRITTEN_ON_CPU:
            yield pytest.param(block, False, id=f"{block.id}:as-written")


@pytest.mark.slow  # ~30 s in all on 2 cores: a fresh interpreter per example, Lightning, transformers, inductor
@pytest.mark.parametrize("block, adapt", list(_cases()))
def test_example_runs(block, adapt, tmp_path):
    _run(block, tmp_path, adapt)
