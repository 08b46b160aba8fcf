"""MiniMax-M3's image and video processors as msaserve code (numpy, Pillow, PyAV, torch's resize):
the same pixel values, grids, chunks and placeholder text as transformers' MiniMaxM3VL processors."""
