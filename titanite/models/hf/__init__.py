"""The Transformers backend (`model.spec = "hf"`): Qwen3 and Qwen3-MoE run through
`AutoModelForCausalLM`, with checkpoints read and written in the Hub's on-disk layout."""
