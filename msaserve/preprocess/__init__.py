"""CPU media pipeline: fetch, decode (Pillow, PyAV), sample, resize, patchify."""
