"""LoRA adapters served beside the base weights: read from PEFT's or torchtune's files, made resident per rank."""
