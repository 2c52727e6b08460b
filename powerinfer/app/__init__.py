"""The commands' bodies, callable without the command line: `main` (one-shot and interactive), batched decoding,
perplexity and bench reports. Each takes a typed options object, drives the runtime (or eval) and writes its
results to stdout and its progress and timings to stderr; `cli/` only parses options into these objects and turns
errors into one line."""
