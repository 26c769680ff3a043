"""Drop-in replacements of SGLang's HiSparse memory classes: the dual
allocators (DSA rows, DeepSeek-V4 C4 rows), the device pools that translate
logical locations to hot-buffer rows, and the pinned host pools."""
