"""`python -m tp_llama.synthetic`: the demo checkpoint writer, kept at its documented name
(tp_llama.testing.synthetic)."""

from tp_llama.testing.synthetic import main

if __name__ == "__main__":
    main()
