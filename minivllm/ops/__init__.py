"""Functional ops, one entry point each. Each is the torch reference today; later chapters
add Triton kernels behind the same entry points."""
