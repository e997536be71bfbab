"""Decoding methods, one file each: propose -> verify -> accept -> update on the shared driver."""
