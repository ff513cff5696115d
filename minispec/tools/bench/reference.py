"""The reference implementation (transformers) on the same checkpoints and prompts: its generate and its
assisted generation, as runners for timing.time_generation."""

import torch

from minispec.loading.checkpoint import resolve_checkpoint


def load_reference(name_or_path, device, dtype):
    """The same checkpoint directory in transformers (imported only here: a test-only dependency)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--compare-reference needs the reference implementation: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    directory = resolve_checkpoint(name_or_path)
    config = transformers.AutoConfig.from_pretrained(directory)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    # .to(dtype) too: versions before `dtype=` was accepted ignore it and load float32.
    return auto.from_pretrained(directory, dtype=dtype).to(device=device, dtype=dtype).eval()


def reference_runner(model, args, gamma=None, draft=None):
    """run_one for time_generation: the reference's generate with the same settings; with a γ assisted
    generation with `draft` (a reference model) or, without one, prompt lookup (our `lookup`)."""
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.ignore_eos:
        # Generate through EOS like minispec does; min_new_tokens would forbid EOS, changing the tokens.
        settings.update(eos_token_id=None, pad_token_id=0)
    if args.temperature > 0:
        settings.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if gamma is not None and draft is None:  # LookupDrafter's max_ngram; for "auto", the reference's usual 10
        settings.update(prompt_lookup_num_tokens=10 if gamma == "auto" else gamma, max_matching_ngram_size=3)

    # with a draft model: exactly γ guesses per step; for "auto", its adaptive defaults (set on every call:
    # the assistant's own generation_config holds them)
    auto = gamma == "auto"
    assist = dict(num_assistant_tokens=20 if auto else gamma, assistant_confidence_threshold=0.4 if auto else 0.0,
                  num_assistant_tokens_schedule="heuristic" if auto else "constant")

    @torch.inference_mode()
    def run_one(request):
        prompt, seed = request
        if draft is not None:
            draft.generation_config.update(**assist)
        ids = torch.tensor([prompt], device=model.device)
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, **settings)[0].tolist()
        # Decoder-only outputs repeat the prompt; encoder-decoder ones start with the decoder start token.
        return out[1 if model.config.is_encoder_decoder else len(prompt):], {}

    return run_one


def reference_runners(args, device, dtype):
    """{("reference", γ or None): run_one}: autoregressive and assisted (none for `ngram`: it lacks it)."""
    model = load_reference(args.target, device, dtype)
    runners = {("reference", None): reference_runner(model, args)}
    if args.draft == "ngram":
        return runners
    draft = None if args.draft == "lookup" else load_reference(args.draft, device, dtype)
    runners.update({("reference", g): reference_runner(model, args, g, draft) for g in args.gamma})
    return runners
