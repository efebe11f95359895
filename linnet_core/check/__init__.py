"""Whether what Linnet computes is the model: the reference (`reference`), the measures of agreement
(`agreement`), the tokens a check runs on (`prompts`), a backend against the reference (`verify`),
quantization's own cost (`quant_effect`), and the exports loaded back in their engines (`roundtrip`)."""
