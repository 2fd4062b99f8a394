"""Default option values, shared by :class:`~hf_magicdec.MagicDecConfig`, the draft views
(:mod:`hf_magicdec.views`, whose fields default to these) and the torch-free planner
(:mod:`hf_magicdec.planner`), so that none imports another for them."""

#: A field left to the planner (:func:`hf_magicdec.plan`).
AUTO = "auto"

# Used when only some fields are left to the planner and it has no candidate (prompt shorter
# than every budget it considers), and by scripts that want a fixed, known configuration.
DEFAULT_DRAFT = "streamingllm"
DEFAULT_BUDGET = 256
DEFAULT_GAMMA = 3
DEFAULT_SINK_TOKENS = 16
DEFAULT_WINDOW = 32
DEFAULT_PAGE_SIZE = 16
DEFAULT_POOL_KERNEL = 5
DEFAULT_PREFILL_CHUNK = 1024
DEFAULT_MAX_GAMMA = 8
MAX_GAMMA = 32

#: The compressed formats of the self-draft's linear layers (``hf_magicdec.engine.draft_weights``).
QUANTIZED_FORMATS = ("int8", "fp16", "int4")
#: ``MagicDecConfig.draft_weights``: the self-draft's linear layers in full precision, or compressed
#: copies; ``"auto"``: the planner chooses per call.
DRAFT_WEIGHT_FORMATS = ("full", *QUANTIZED_FORMATS, AUTO)
