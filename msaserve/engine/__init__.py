"""One replica's engine: scheduler, block manager, model runner, sampler, streaming."""
