"""MiniMax-M3 (model_type minimax_m3_vl): text model, vision tower, checkpoint names."""
