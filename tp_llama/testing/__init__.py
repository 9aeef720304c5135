"""What the tests and the demo need and the product does not: synthetic checkpoints in Meta's
layout and the tokenizers they carry (synthetic, tokenizer_train), the DTensor oracle of the
tensor-parallel modules (oracle), and fault injection (faults). Model archives leave it out
unless a test asks for it."""
