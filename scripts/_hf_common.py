"""Shared helpers for the fixture and embedded-model scripts (build-time only).

Needs torch/transformers/tokenizers/onnxruntime; never imported by the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode character map (used by ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_byte_tokenizer(folder: str | os.PathLike, vocab_size: int) -> None:
    """Write an offline byte-level tokenizer: token id i == byte i for i < 256,
    then <s>=256, </s>=257, <pad>=258, and unused fillers up to vocab_size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(256)}
    specials = ["<s>", "</s>", "<pad>"]
    for j, s in enumerate(specials):
        vocab[s] = 256 + j
    for i in range(259, vocab_size):
        vocab[f"<unused{i - 259}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2) + "\n"
    )


def builder_error(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, cache_dir: str | os.PathLike, precision: str = "fp32"
) -> str | None:
    """Run the ONNX Runtime GenAI model builder (cpu, ``precision`` fp32 or int4) on a local HF folder.

    Returns None on success, else the builder's error: its innermost traceback frame and last line.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(out_dir),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(cache_dir),
        "--extra_options",
        "hf_token=false",
    ]
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    lines = [x.strip() for x in (r.stdout + "\n" + r.stderr).splitlines() if x.strip()]
    frames = [re.sub(r'"[^"]*site-packages/', '"', x) for x in lines if x.startswith("File ")]
    return " / ".join(frames[-1:] + lines[-1:])


def run_genai_builder(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, cache_dir: str | os.PathLike, precision: str = "fp32"
) -> None:
    """:func:`builder_error`, exiting with the builder's error when it fails."""
    err = builder_error(hf_dir, out_dir, cache_dir, precision)
    if err is not None:
        raise SystemExit(f"builder failed: {err}")


def exporter_versions() -> dict[str, str]:
    """Versions of the exporters and runtimes (printed); torch is set to the machine's 2 threads."""
    import onnx
    import onnxruntime
    import onnxruntime_genai
    import torch
    import transformers

    torch.set_num_threads(2)
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime_genai": onnxruntime_genai.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    print("versions:", versions)
    return versions


def op_counts(model_path: str | os.PathLike) -> dict[str, int]:
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    counts: dict[str, int] = {}
    for n in m.graph.node:
        key = (n.domain + "." if n.domain and n.domain != "ai.onnx" else "") + n.op_type
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def graph_io(model_path: str | os.PathLike) -> tuple[list[str], list[str]]:
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)

    def fmt(v):
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        return f"{v.name}: {onnx.TensorProto.DataType.Name(t.elem_type)}{dims}"

    return [fmt(v) for v in m.graph.input], [fmt(v) for v in m.graph.output]


def gqa_attributes(model_path: str | os.PathLike) -> list[dict]:
    import onnx
    from onnx import helper

    m = onnx.load(str(model_path), load_external_data=False)
    out = []
    for n in m.graph.node:
        if n.op_type in ("GroupQueryAttention", "Attention", "MultiHeadAttention"):
            out.append(
                {
                    "name": n.name,
                    "op": f"{n.domain}.{n.op_type}",
                    **{a.name: helper.get_attribute_value(a) for a in n.attribute},
                }
            )
    return out


class OrtDecoder:
    """Minimal onnxruntime driver for a decoder graph with past/present KV tensors.

    Works for GenAI builder graphs (past_key_values.N.key, present.N.key) and
    torch exports (same names). Attention mask covers past + new tokens.
    """

    def __init__(self, model_path: str | os.PathLike, threads: int = 2, head_size: int | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.past_names = [n for n in self.inputs if n.startswith("past_key_values.")]
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.present_names = [n for n in self.out_names if n.startswith("present")]
        shp = self.inputs[self.past_names[0]].shape
        self.kv_heads = int(shp[1])
        if head_size is None:
            if isinstance(shp[3], int):
                head_size = shp[3]
            else:  # GenAI builder graphs name it 'kv_cache_dim'; genai_config.json knows it
                gc = pathlib.Path(model_path).parent / "genai_config.json"
                head_size = json.loads(gc.read_text())["model"]["decoder"]["head_size"]
        self.head_size = int(head_size)

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((batch, self.kv_heads, 0, self.head_size), np.float32) for n in self.past_names}

    def step(self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]):
        """ids: [B, S] int64 new tokens; mask: [B, past+S] int64. Returns (logits, new_past)."""
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
        if "position_ids" in self.inputs:
            pos = np.cumsum(mask, axis=1) - 1
            pos = np.where(mask == 0, 1, pos)
            feeds["position_ids"] = pos[:, -ids.shape[1] :].astype(np.int64)
        feeds.update(past)
        outs = dict(zip(self.out_names, self.sess.run(None, feeds)))
        new_past = {}
        for n in self.past_names:
            new_past[n] = outs[n.replace("past_key_values.", "present.")]
        return outs["logits"], new_past

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
        ids = np.array([prompt], np.int64)
        mask = np.ones_like(ids)
        past = self.empty_past(1)
        out, all_logits = [], []
        logits, past = self.step(ids, mask, past)
        for _ in range(steps):
            last = logits[:, -1, :]
            all_logits.append(last[0].copy())
            nxt = int(last[0].argmax())
            out.append(nxt)
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            logits, past = self.step(np.array([[nxt]], np.int64), mask, past)
        return out, all_logits


def dir_size(path: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


@contextlib.contextmanager
def scratch_dir(prefix: str, keep: bool):
    """A new temporary folder for the body, removed afterwards unless ``keep`` (then its path is printed)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        if keep:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def copy_only(src: pathlib.Path, dst: pathlib.Path, names: list[str]) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for n in names:
        if (src / n).exists():
            shutil.copy2(src / n, dst / n)
