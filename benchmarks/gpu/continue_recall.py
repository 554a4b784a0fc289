# SPDX-License-Identifier: Apache-2.0
"""One device call that continues a recall model to longer prompts (issue 48), packed to come back.

Runs the training script of ``shared/prototypes/recall-training`` (``recall_long.py``,
carried with ``recall12.py`` beside it: ``../shared`` does not travel to a lent GPU) on a
copy of ``--init`` whose RoPE positions are, with ``--rope-linear-factor F``,
interpolated linearly (``rope_parameters`` ``{"rope_type": "linear", "factor": F}``:
F x the trained length maps onto it); every argument after ``--`` goes to the training
script. Then packs what a session commits: the model in bfloat16, one
``model.safetensors`` (the float32 ``config.json`` kept, so that a run continued from it
trains in float32), ``--init``'s tokenizer files, the run's ``results.json`` and held-out
prompts, as ``recall.tgz`` split into parts of at most 15 MiB in ``--pack-to`` (a lent
machine returns at most 8 files of 16 MiB from ``$OUT``).

    python3 -m benchmarks.gpu.continue_recall --scripts CARRIED/recall-training \\
        --init benchmarks/models/recall-llama-12l-toward-16k --rope-linear-factor 4 \\
        --work /tmp/recall --pack-to $OUT -- --train-seconds 450 \\
        --stages 8192:4 12288:3 16384:2 --max-pos 32768 \\
        --eval 4096:96 8192:190 16384:200 --n-eval 150

Back here: ``cat recall.tgz.part* | tar xz`` gives ``checkpoint/`` (the model folder to
commit) and ``run/`` (results and held-out prompts). ``-- --smoke --device cpu`` runs
the whole on a CPU in seconds (the unit test does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.accuracy.recall_lengths import linear_rope

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PART_BYTES = 15 << 20


def prepare(init: Path, dest: Path, rope_linear_factor: float | None) -> Path:
    """A copy of ``init`` with its RoPE positions interpolated by the factor (if any)."""
    shutil.copytree(init, dest, ignore=shutil.ignore_patterns("README.md"))
    if rope_linear_factor is not None:
        config_path = dest / "config.json"
        config = json.loads(config_path.read_text())
        config["rope_parameters"] = linear_rope(config.get("rope_parameters"),
                                                rope_linear_factor)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    return dest


def checkpoint(trained: Path, init: Path, dest: Path) -> Path:
    """The trained float32 shards as one bfloat16 ``model.safetensors``, with their
    config and generation config and ``init``'s tokenizer files."""
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    tensors = {}
    for shard in sorted(trained.glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()},
              dest / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copy(trained / name, dest / name)
    for name in TOKENIZER_FILES:
        shutil.copy(init / name, dest / name)
    return dest


def pack(work: Path, names: list[str], out: Path) -> list[Path]:
    """``work``'s ``names`` as ``out/recall.tgz.partNN`` of at most 15 MiB each."""
    out.mkdir(parents=True, exist_ok=True)
    archive = work / "recall.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in names:
            tar.add(work / name, arcname=name)
    data = archive.read_bytes()
    parts = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        parts.append(out / f"recall.tgz.part{index:02d}")
        parts[-1].write_bytes(data[start:start + PART_BYTES])
    return parts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, training = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scripts", type=Path, required=True,
                        help="the folder with recall_long.py and recall12.py")
    parser.add_argument("--init", type=Path, required=True, help="the model to continue")
    parser.add_argument("--rope-linear-factor", type=float, default=None)
    parser.add_argument("--work", type=Path, required=True, help="an empty or new folder")
    parser.add_argument("--pack-to", type=Path, required=True, help="where the parts go")
    args = parser.parse_args(ours)
    script = args.scripts / "recall_long.py"
    if not script.is_file():
        raise SystemExit(f"no {script}: carry shared/prototypes/recall-training there")
    if "--out" in training or "--init" in training:
        raise SystemExit("--init and --out are this script's, not the training's")
    if args.work.exists() and any(args.work.iterdir()):
        raise SystemExit(f"--work {args.work} is not empty")
    prepared = prepare(args.init, args.work / "init", args.rope_linear_factor)
    run = args.work / "run"
    command = [sys.executable, str(script), "--init", str(prepared), "--out", str(run),
               *training]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    checkpoint(run / "model", args.init, args.work / "checkpoint")
    shutil.rmtree(run / "model")  # float32: the checkpoint has it in bfloat16
    for part in pack(args.work, ["checkpoint", "run"], args.pack_to):
        print(part, part.stat().st_size, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
