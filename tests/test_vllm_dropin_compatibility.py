"""book/compatibility.md is written from the code's own lists (minivllm.compatibility):
it equals what the code says today, and every status it gives is one the code acts on."""
from pathlib import Path

import pytest

from minivllm.compatibility import ACCEPTED, REFUSED, llm_keywords, render, serve_flags

PAGE = Path(__file__).parents[1] / "book" / "compatibility.md"


def test_the_page_is_the_codes():
    assert PAGE.read_text() == render(), \
        "book/compatibility.md is stale: python -m minivllm.compatibility > book/compatibility.md"


def test_the_page_is_in_the_book():
    assert "file: book/compatibility" in (PAGE.parents[1] / "_toc.yml").read_text()


@pytest.mark.parametrize("status", [ACCEPTED, REFUSED])
def test_every_keyword_marked_is_treated_so(tiny_qwen3_with_tokenizer, status, caplog):
    """A keyword the page calls accepted starts an engine config with a notice; one it calls
    refused raises, naming itself."""
    import logging

    from minivllm.engine.engine_args import create_engine_config

    for name, marked, _ in llm_keywords():
        if marked != status:
            continue
        name = name.strip("`")
        value = {"swap_space": 4.0, "cpu_offload_gb": 1.0, "data_parallel_size": 2, "max_loras": 2,
                 "max_lora_rank": 8, "lora_modules": ["a=b"], "limit_mm_per_prompt": {"image": 1},
                 "mm_processor_kwargs": {"x": 1}, "tokenizer_mode": "auto", "download_dir": "/tmp",
                 "load_format": "safetensors", "reasoning_parser": "qwen3"}.get(name, True)
        if status == REFUSED:
            with pytest.raises(ValueError, match=name):
                create_engine_config(tiny_qwen3_with_tokenizer, device="cpu", **{name: value})
        else:
            with caplog.at_level(logging.INFO, logger="minivllm.engine.engine_args"):
                create_engine_config(tiny_qwen3_with_tokenizer, device="cpu", **{name: value})
            assert f"{name} accepted" in caplog.text


def test_flags_marked_as_the_parser_marks_them():
    rows = {flags: status for flags, status, _ in serve_flags()}
    assert rows["`--trust-remote-code`"] == ACCEPTED and rows["`--enable-lora`"] == REFUSED
    assert rows["`--reasoning-parser`"] == "supported"
