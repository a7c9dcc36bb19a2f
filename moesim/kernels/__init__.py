"""Routing features counted from expert ids with Numba (numpy and numba only: no models, no
hardware): windows, unions of ragged windows, locality, and plain-numpy references."""
