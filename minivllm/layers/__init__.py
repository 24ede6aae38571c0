"""Building blocks of a decoder-only transformer, as nn.Modules."""
