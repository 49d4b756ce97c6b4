"""Decoding: member bytes to pixels (JPEG, PNG, the formats PIL reads, .npy) and labels, within the image-size caps."""
