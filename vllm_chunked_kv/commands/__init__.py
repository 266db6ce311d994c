"""The `vllm-chunked-kv` command (`main`) and the subcommands that belong to no
tool package (`quickstart`, `doctor`)."""
