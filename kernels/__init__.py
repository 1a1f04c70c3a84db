"""Triton kernels, installed as ``pyembed.kernels`` (DESIGN §4). Empty until the
Triton backend lands; importing this package never imports triton."""
