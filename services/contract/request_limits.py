"""The limits on a generation request that both the gateway (on the HTTP body) and the processor
(on every caller of its internal RPC) enforce: one definition, so the two cannot drift."""

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
# The widths of the protobuf fields the values travel in.
UINT32_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1
