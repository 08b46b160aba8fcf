"""MiniMax-M3 (`model_type` minimax_m3_vl / minimax_m3_vl_text): config, text model, checkpoint
names. The vision tower lives in `vision.py`; the reference is transformers' minimax_m3_vl."""
