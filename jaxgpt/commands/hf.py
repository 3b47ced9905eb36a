"""Hugging Face directories (GPT-2, NanoChat, Llama, Mistral, Qwen2, Qwen3, Gemma 3): check one, or export a run.

    jaxgpt hf inspect PATH       # what a HF directory (or hf:OWNER/NAME Hub repository) maps to, tensor by tensor
    jaxgpt hf export --workdir DIR --out PATH [--which best] [--overwrite] [--merge] [--push_to_hub OWNER/NAME]
    jaxgpt hf export --workdir DIR --out FILE.gguf --format gguf [--gguf_type F32|F16|Q8_0]

An export is `config.json` + `model.safetensors` as the family whose architecture the run's model has
(`GPT2LMHeadModel`, `NanoChatForCausalLM` for nanochat's options, `LlamaForCausalLM` and its kin: `jaxgpt.io.hf`),
loadable by `AutoModelForCausalLM.from_pretrained(PATH)`; the run's tokenizer (GPT-2's vocab.json + merges.txt, a
character or word vocabulary as tokenizer.json, or a Hugging Face model's own tokenizer.json), with a chat run's
special tokens and chat template (`apply_chat_template` then gives the ids jaxgpt trains on and serves); and
generation_config.json, so that `transformers.pipeline("text-generation", model=PATH)` writes what `jaxgpt sample`
writes. Writing the tokenizer needs transformers. A classifier's head, which a language model has no place for, is
left out. `--push_to_hub` then uploads the directory to that Hub repository (creating it; needs a login: hf auth
login). A LoRA run (config.lora) exports as a PEFT adapter (`jaxgpt.io.peft`: adapter_config.json +
adapter_model.safetensors, for `peft.PeftModel.from_pretrained` on its base), or with `--merge` as the full model
with its adapters merged. `--format gguf` writes a Llama, Qwen2, Qwen3 or Gemma 3 run (a LoRA run
merged) as one llama.cpp GGUF file instead (`jaxgpt.io.gguf_export`), with a byte-level BPE tokenizer and chat
template inside it."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
from absl import flags
from flax import traverse_util

from jaxgpt import storage
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data import hf_tokenizer
from jaxgpt.data.conversations import END, load_template
from jaxgpt.data.tokenizer import WithSpecialTokens
from jaxgpt.data.tokenizer_json import TYPE as JSON_TYPE
from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError, one_line, optional_import
from jaxgpt.io import peft, weights
from jaxgpt.io.gguf_export import GGUF_TYPES, check_exportable, check_type, save_gguf
from jaxgpt.io.hf import export_family, load_hf, save_hf
from jaxgpt.tools.summary import count_params

SUBCOMMANDS = ("inspect", "export")
INSPECTED_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "d_ff",
                    "activation", "norm", "norm_eps", "rope_theta", "logit_softcap", "tie_embeddings", "embd_dropout",
                    "attn_dropout", "resid_dropout")


# The flags of `export` that name a file or directory, and what each takes (`storage.check`).
LOCATIONS = {"workdir": storage.ANYWHERE, "out": storage.ANYWHERE, "bpe_file": storage.LOCAL}


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    """Only the flags of the sub-command named first (`inspect` has none)."""
    if list(argv[1:2]) != ["export"]:
        return
    flags.DEFINE_string("workdir", None, "a jaxgpt training work directory", flag_values=flags_)
    flags.DEFINE_string("out", None, "the directory to write (config.json + model.safetensors), or the .gguf file "
                        "(--format gguf)", flag_values=flags_)
    flags.mark_flags_as_required(["workdir", "out"], flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_bool("overwrite", False, "replace the checkpoint in a non-empty --out", flag_values=flags_)
    flags.DEFINE_bool("merge", False, "a LoRA run: write the full merged model instead of a PEFT adapter",
                      flag_values=flags_)
    flags.DEFINE_string("push_to_hub", None, "then upload --out to this Hugging Face Hub repository (OWNER/NAME)",
                        flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "local GPT-2 ranks file (gpt2.tiktoken) for BPE runs", flag_values=flags_)
    flags.DEFINE_enum("format", "hf", ("hf", "gguf"), "a Hugging Face directory, or one GGUF file (Llama family)",
                      flag_values=flags_)
    flags.DEFINE_string("gguf_type", "F32", f"the tensor type of --format gguf: {', '.join(GGUF_TYPES)}",
                        flag_values=flags_)


def inspect(path: str) -> str:
    """A report of how a HF directory maps onto jaxgpt, after reading and checking every tensor."""
    params, cfg = load_hf(weights.hf_directory(path.removeprefix("hf:"), "`hf inspect` PATH"))
    shapes = {path: tuple(value.shape) for path, value in traverse_util.flatten_dict(params).items()}
    family = export_family(cfg)
    lines = [f"{path}: {family.name} checkpoint, all {len(family.tensor_specs(cfg))} tensors present with the "
             "expected shapes"]
    lines += [f"  {name:<15}{getattr(cfg, name)}" for name in INSPECTED_FIELDS]
    lines.append(f"  {'parameters':<15}{count_params(shapes):,}")
    return "\n".join(lines)


def export(workdir: str, out: str, which: str, overwrite: bool, bpe_file: str | None = None,
           merge: bool = False) -> str:
    """Write the run as a Hugging Face directory (weights, tokenizer, generation config), locally or into a
    bucket: there it is written locally first and uploaded with config.json last (a loader's sign of a
    complete export; an overwrite removes the old one first)."""
    if not storage.is_bucket(out):
        return _export(workdir, out, which, overwrite, bpe_file, merge)
    target = storage.location(out, "--out")
    if storage.files(target) and not overwrite:
        raise UserError(f"{out} exists and is not empty: choose a new location or pass --overwrite to replace its "
                        "checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        report = _export(workdir, tmp, which, overwrite, bpe_file, merge)
        commit = "config.json" if (Path(tmp) / "config.json").exists() else peft.CONFIG_FILE
        storage.publish(Path(tmp), target, sorted(p.name for p in Path(tmp).iterdir()), commit=commit)
    return report.replace(tmp, out, 1)


def _export(workdir: str, out: str, which: str, overwrite: bool, bpe_file: str | None, merge: bool) -> str:
    loaded = weights.load(f"workdir:{workdir}", which=which, merge_lora=merge)
    if "lora" in loaded.meta and not merge:
        return _export_peft(loaded, workdir, out, overwrite)
    weights.require_gpt(f"workdir:{workdir}", loaded.model, "be exported to Hugging Face")
    tokenizer = None if loaded.tokenizer_meta is None else loaded.tokenizer(bpe_file)
    hf_tokenizer.require_transformers()  # before anything is written: an export without its tokenizer is no use
    params = dict(loaded.params)
    dropped = [k for k in ("cls_head",) if params.pop(k, None) is not None]
    template = load_template(workdir, None)  # the run's chat template, as `jaxgpt serve` finds it
    root = save_hf(params, loaded.model, out, overwrite=overwrite,
                   eot_token=None if tokenizer is None else tokenizer.eot_token)
    if tokenizer is not None:
        hf_tokenizer.save_hf_tokenizer(tokenizer, root, loaded.model.block_size, chat_template=template)
    end = tokenizer.special_ids.get(END) if isinstance(tokenizer, WithSpecialTokens) else None
    hf_tokenizer.save_generation_config(tokenizer, root, end)
    notes = []
    if dropped:
        notes.append(f"left out {', '.join(dropped)}: a Hugging Face language model has no such head")
    if tokenizer is None:
        notes.append("no tokenizer: the run records none")
    files = ", ".join(sorted(p.name for p in root.iterdir()))
    return f"wrote {root} from {workdir} ({which}): {files}" + "".join(f" ({n})" for n in notes)


def _export_peft(loaded: weights.Weights, workdir: str, out: str, overwrite: bool) -> str:
    """Write a LoRA run's adapters (`loaded` unmerged) as a PEFT directory; the report line."""
    root = Path(out)
    if root.exists() and any(root.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not empty: choose a new directory or pass --overwrite")
    settings = loaded.meta["lora"]
    base = settings["base"]["source"]
    peft.check_carried(loaded.model, weights.describe(base)[0], settings, workdir)
    peft.write_peft(jax.device_get(loaded.params), loaded.model, settings, root, base.removeprefix("hf:"))
    return (f"wrote a PEFT adapter {root} from {workdir} ({loaded.description}): {peft.CONFIG_FILE}, "
            f"{peft.TENSORS_FILE}; its base is {base} (--merge writes the merged model instead)")


def export_gguf(workdir: str, out: str, which: str, overwrite: bool, gguf_type: str) -> str:
    """Write the run as one GGUF file (a local path): weights, and a byte-level BPE tokenizer and chat template."""
    check_type(gguf_type)
    if storage.is_bucket(out):
        raise UserError(f"--out={out}: a GGUF export is written to a local file; copy it to the bucket afterwards")
    path = Path(out)
    if path.is_dir() or path.suffix != ".gguf":
        raise UserError(f"--out={out} must name a .gguf file for --format gguf")
    if path.exists() and not overwrite:
        raise UserError(f"{out} exists: choose a new file or pass --overwrite to replace it")
    loaded = weights.load(f"workdir:{workdir}", which=which)
    weights.require_gpt(f"workdir:{workdir}", loaded.model, "be exported to GGUF")
    check_exportable(loaded.model, gguf_type)
    meta = loaded.tokenizer_meta or {}
    json_tokenizer = JsonTokenizer.from_meta(meta) if meta.get("type") == JSON_TYPE else None
    params = {k: v for k, v in loaded.params.items() if k != "cls_head"}
    save_gguf(params, loaded.model, path, gguf_type, json_tokenizer, load_template(workdir, None),
              name=Path(workdir).name)
    note = "" if json_tokenizer is not None else (" (no tokenizer: GGUF holds a byte-level BPE tokenizer.json, "
                                                  "the run's is another kind or none)")
    return f"wrote {path} ({gguf_type}) from {workdir} ({which}){note}"


def push_to_hub(out: str, repo: str) -> str:
    """Upload an export directory to a Hub repository, creating it if needed."""
    HfApi = optional_import("huggingface_hub", "--push_to_hub").HfApi
    try:
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        commit = api.upload_folder(repo_id=repo, folder_path=out)
    except Exception as e:  # authentication, network and permission errors come in many types
        raise UserError(f"pushing {out} to the Hub as {repo} failed ({type(e).__name__}: {one_line(e, 100)}); the "
                        f"export in {out} is complete: upload it later with `hf upload {repo} {out}`") from None
    return f"pushed {out} to {getattr(commit, 'commit_url', repo)}"


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        raise UserError("give a sub-command first: `jaxgpt hf inspect PATH` or `jaxgpt hf export --workdir DIR "
                        "--out PATH` (see --help)")
    if args[0] == "inspect":
        if len(args) != 2:
            raise UserError(f"`jaxgpt hf inspect` takes one Hugging Face directory, got {len(args) - 1} arguments")
        print(inspect(args[1]))
        return
    no_arguments(args[1:])
    if flags_.push_to_hub is not None and not weights.HUB_ID.fullmatch(flags_.push_to_hub):
        raise UserError(f"--push_to_hub={flags_.push_to_hub} is not a Hub repository id: use OWNER/NAME")
    if flags_.format == "gguf":
        if flags_.push_to_hub is not None:
            raise UserError("--push_to_hub uploads a Hugging Face directory: export with --format hf to push")
        print(export_gguf(flags_.workdir, flags_.out, flags_.which, flags_.overwrite, flags_.gguf_type))
        return
    print(export(flags_.workdir, flags_.out, flags_.which, flags_.overwrite, flags_.bpe_file, flags_.merge))
    if flags_.push_to_hub is not None:
        print(push_to_hub(flags_.out, flags_.push_to_hub))


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
