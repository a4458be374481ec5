"""workers/model/packing.py's host and index parts: the attention name it registers, the layout
per device, the varlen batch's one buffer and the token map built from it (the packed forward
against padded batches: tests/integration/workers/test_packing.py)."""

from __future__ import annotations

import torch

from embedfleet.workers.model.packing import (
    VARLEN_ATTENTION,
    collate_varlen,
    preferred_layout,
    takes_token_types,
    token_map,
    varlen_attention_name,
)
from embedfleet.workers.model.tokenizer import Tokenized


def test_the_registered_name_never_reads_as_a_flash_attention_kernel() -> None:
    assert varlen_attention_name("sdpa") == f"{VARLEN_ATTENTION}_sdpa"
    name = varlen_attention_name("flash_attention_2")
    assert "flash" not in name and name == f"{VARLEN_ATTENTION}_fa_attention_2"


def test_a_cpu_keeps_the_padded_layout_in_every_dtype() -> None:
    cpu = torch.device("cpu")
    assert preferred_layout(cpu) == preferred_layout(cpu, torch.bfloat16) == "padded"


def test_a_varlen_batch_is_its_offsets_then_every_id_end_to_end() -> None:
    batch = collate_varlen(
        [Tokenized([101, 5, 102], False), Tokenized([101, 102], False), Tokenized([1] * 4, True)]
    )
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert batch.input_ids.tolist() == [101, 5, 102, 101, 102, 1, 1, 1, 1]
    assert batch.buffer.dtype == torch.int32
    assert (batch.size, batch.real_tokens, batch.padded_tokens) == (3, 9, 9)
    assert (batch.longest, batch.shortest) == (4, 2)


def test_the_token_map_says_whose_each_token_is_and_where() -> None:
    tokens = token_map(torch.tensor([0, 3, 5, 9], dtype=torch.int32), real_tokens=9)
    assert tokens.owner.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert tokens.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert tokens.first.tolist() == [0, 3, 5] and tokens.lengths.tolist() == [3, 2, 4]


def test_a_model_taking_token_types_is_told_apart() -> None:
    class WithTypes(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> None: ...

    assert takes_token_types(WithTypes())
    assert not takes_token_types(torch.nn.Linear(2, 2))
