"""Sharding: where every parameter element lives (layout), the flat buffer whose views are the
model's weights, the generation memory over the driver's VMM API, the train <-> generate switch and
checkpoints. `layout` and `buffer` are plain data and are what the model sees."""
