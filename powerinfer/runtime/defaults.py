"""Engine defaults that the command line shares with the library, in a leaf without torch (cli/ reads them at
start-up)."""

# activations of the quant matmuls, for the library (EngineOptions) and every command alike: int8 blocks as
# llama.cpp computes them (the speed a user expects of a llama.cpp drop-in); "f32" decodes the weights to floats
# in registers, exact against float references such as transformers, slower (ops.context)
DEFAULT_ACT_PRECISION = "q8"
