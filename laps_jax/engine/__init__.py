"""KV pages, prefix cache, compiled executables, the model runner and sampling."""
