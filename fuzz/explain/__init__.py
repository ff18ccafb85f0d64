"""What a reader of a finding sees: the side-by-side text (render), the byte map and its picture
(bytemap, picture, picture_layout, picture_text) and vLLM's error in words (vllm_error)."""
