"""The goals the report holds results against, and each bench's default peer."""

GOAL = {"switch_vs_nccl": 1.15, "switch_vs_deepspeed": 1.5, "unit_gather_vs_nccl": 0.9, "decode_step_vs_floor": 1.5,
        "e2e_vs_deepspeed": 3.0, "e2e_switch_share": 0.05}
"""Switch time <= 1.15 x the NCCL all-gather of its bytes and >= 1.5x faster than DeepSpeed ZeRO-3's gather;
unit-gather bus bandwidth >= 0.9 x NCCL's; decode step within 1.5x of its floor; the whole GRPO step >= 3x a
DeepSpeed ZeRO-3 loop, with the switch under 5% of it."""
PEER = {"switch": "fsdp2", "generate": "hf_generate", "train_step": "fsdp2", "segment_copy": "torch_copy"}
"""The peer each bench's "speed vs" column compares against."""
HEADLINE_MODEL = "qwen2-7b"
"""The README's model where a bench measured several."""
