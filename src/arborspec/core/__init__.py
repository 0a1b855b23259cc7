"""The ground floor: the token tree, sampling, the disk cache, option parsing, downloads and the isotonic fit. Nothing
here imports from the rest of arborspec, so every other floor can use it."""
