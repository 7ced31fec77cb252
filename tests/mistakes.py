"""Plausible mistakes, each put into a scratch copy of the script, and the tests that catch it.

    python tests/mistakes.py            # every mistake (a few minutes on 2 cores)
    python tests/mistakes.py p95_as_p90 # the ones named

Run by hand, not by pytest or CI. For each mistake it copies the project to a temporary folder, makes the
one edit (which must match the script exactly once), and runs the tests meant to catch it there; it first
runs those tests on an unedited copy, which must pass. It prints a line a mistake, and exits with 1 if any
mistake got through.
"""

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, what it breaks, the exact text of the script, what the mistake makes of it, the tests that guard it
MISTAKES = [
    ("ddp_off", "torchrun without gradient sync",
     "    if world > 1:\n        step_model =", "    if False:\n        step_model =",
     ["test_processes.py::test_two_processes_train_as_one_at_the_same_global_batch"]),
    ("no_temperature", "a sampler that ignores the temperature",
     "    logits = logits.float() / temperature\n", "    logits = logits.float()\n",
     ["test_speculative.py::test_sampled_speculation_has_the_full_model_distribution",
      "test_foundation.py::test_temperature_and_top_k_shape_the_distribution"]),
    ("tail_off_by_one", "an anti-conservative binomial test, one failure short",
     "        if binomial_tail(k, n, epsilon) > delta:", "        if binomial_tail(k - 1, n, epsilon) > delta:",
     ["test_calibration.py::test_one_threshold_is_certified_exactly_up_to_its_binomial_boundary",
      "test_calibration.py::test_calibration_keeps_its_guarantee_and_the_naive_rule_does_not"]),
    ("twice_delta", "fixed-sequence testing at twice delta",
     "        if binomial_tail(k, n, epsilon) > delta:", "        if binomial_tail(k, n, epsilon) > 2 * delta:",
     ["test_calibration.py::test_one_threshold_is_certified_exactly_up_to_its_binomial_boundary"]),
    ("held_twice_epsilon", "'held' on the shifted text at twice epsilon",
     '"held": figures["disagreement"] <= epsilon}', '"held": figures["disagreement"] <= 2 * epsilon}',
     ["test_calibration.py::test_held_is_disagreement_within_epsilon_one_position_either_side"]),
    ("generous_oracle", "an oracle that spends its budget at layer 0 whatever the exits checked",
     "    return exit_summary(records, first_exit(agree, checked_exits))\n",
     "    return exit_summary(records, first_exit(agree, checked_exits).index_fill(0, deepest, 0))\n",
     ["test_worth_it.py::test_the_oracle_spends_its_budget_where_it_saves_most"]),
    ("resume_evaluates_again", "a resumed loop that evaluates its first step again",
     "it % config.eval_interval == 0 and it > start_iter:", "it % config.eval_interval == 0 and it > 0:",
     ["test_robustness.py::test_ctrl_c_saves_and_resume_repeats_the_uninterrupted_run"]),
    ("resume_fresh_batches", "a resumed process that draws its batches from the start again",
     "    for _ in range(done):\n        get_batch", "    for _ in range(0):\n        get_batch",
     ["test_robustness.py::test_a_crashed_run_resumes_from_its_last_periodic_checkpoint",
      "test_processes.py::test_a_resumed_process_draws_its_own_batches"]),
    ("drafts_one_early", "every kept-draft mark one token early",
     "    exited.scatter_(1, at, marks)", "    exited.scatter_(1, (at - 1).clamp(min=0), marks)",
     ["test_speculative.py::test_kept_drafts_are_marked_round_by_round"]),
    ("teacher_forcing_off_by_one", "teacher forcing misaligned by one",
     "            tokens[:, n] = forced[:, i]", "            tokens[:, n] = forced[:, max(i - 1, 0)]",
     ["test_foundation.py::test_cached_logits_equal_uncached_past_block_size"]),
    ("sampler_slightly_off", "speculative sampling that keeps drafts a little too often",
     "        keep = torch.rand(B, k, generator=generator, device=drafts.device) < ratio",
     "        keep = torch.rand(B, k, generator=generator, device=drafts.device) < 1.25 * ratio",
     ["test_speculative.py::test_sampled_speculation_has_the_full_model_distribution",
      "test_speculative.py::test_accept_rule_is_exact_and_a_wrong_rule_is_caught"]),
    ("draft_model_skips_layers", "a draft model's drafts verified from the layer above its last",
     "        x, first = model.transformer.wte(fed) + model.transformer.wpe(slots), 0",
     "        x, first = model.transformer.wte(fed) + model.transformer.wpe(slots), draft_exit + 1",
     ["test_frontier.py::test_a_draft_model_drafts_what_layer_zero_would_and_verifies_at_full_depth"]),
    ("one_drafter_for_both", "self_speculative drafting with the draft model",
     '"draft": None,', '"draft": draft,',
     ["test_frontier.py::test_each_drafter_is_the_one_its_name_says"]),
    ("prune_the_most_distant", "pruning the blocks that change the residual stream most",
     "keep = sorted(sorted(range(len(distances)), key=distances.__getitem__)[k:])",
     "keep = sorted(sorted(range(len(distances)), key=distances.__getitem__)[: len(distances) - k])",
     ["test_frontier.py::test_pruning_removes_the_blocks_that_change_the_residual_stream_least"]),
    ("ties_dominate", "a point beaten by its equal",
     "return faster >= 0 and margin > 2 * error or faster > 0 and margin == error == 0",
     "return faster >= 0 and margin > 2 * error or faster >= 0 and margin == error == 0",
     ["test_worth_it.py::test_a_point_is_beaten_only_by_one_no_worse_on_both_axes"]),
    ("kv_bytes_of_a_full_batch", "the cache of a whole batch counted for one sequence",
     "checks, (cache.k.nbytes + cache.v.nbytes) / B)", "checks, (cache.k.nbytes + cache.v.nbytes))",
     ["test_frontier.py::test_memory_is_read_from_the_tensors_a_decoder_holds"]),
    ("p95_as_p90", "the tail's p95 computed as p90",
     "np.percentile(gaps, [50, 95, 99])", "np.percentile(gaps, [50, 90, 99])",
     ["test_worth_it.py::test_tail_latency_as_a_streaming_reader_sees_it"]),
    # the fourteen bugs the house-in-order review found, each put back
    ("backfill_checks_on", "1: backfill checking exits after every row has left",
     "        if n_exited == B:\n", "        if n_exited == B and type(strategy) is not Backfill:\n",
     ["test_foundation.py::test_backfill_checks_no_exit_after_a_token_has_left"]),
    ("round_spread_over_tokens", "2: a speculation round's time spread over its tokens",
     "        for (_, m), (t, n) in itertools.pairwise(out.clock):  # a step's tokens arrive as it ends\n"
     "            arrivals += [1e3 * (t - t0)] * (n - m)\n",
     "        for (s, m), (t, n) in itertools.pairwise(out.clock):\n"
     "            arrivals += [1e3 * (s - t0 + (t - s) * (j + 1) / (n - m)) for j in range(n - m)]\n",
     ["test_worth_it.py::test_tail_latency_as_a_streaming_reader_sees_it"]),
    ("best_rule_on_test", "3: the rule chosen by its test figures",
     'key=lambda r: r["val"]["compute_saved"])', 'key=lambda r: r["test"]["compute_saved"])',
     ["test_calibration.py::test_the_rule_is_chosen_on_val_and_calibrated_for_the_choice"]),
    ("no_bonferroni", "3: each rule calibrated at delta before one is chosen",
     "checked_exits, epsilon, delta / len(rules))", "checked_exits, epsilon, delta)",
     ["test_calibration.py::test_the_rule_is_chosen_on_val_and_calibrated_for_the_choice"]),
    ("smaller_models_small_batch", "4: plain GPTs at one process's batch under torchrun",
     "alpha=0.0, batch_size=config.batch_size * world)", "alpha=0.0, batch_size=config.batch_size)",
     ["test_processes.py::test_the_smaller_models_train_at_the_main_models_global_batch"]),
    ("sample_only_every_rank", "5: --sample_only on every rank of torchrun",
     'if config.sample_only and int(os.environ.get("RANK", "0")) > 0:', "if False:",
     ["test_processes.py::test_sample_only_under_torchrun_runs_in_rank_0_alone"]),
    ("few_sweep_positions", "6: a --sweep_positions too small for the learned rule's pieces",
     '"[10, inf)": "sweep_positions"', '"[9, inf)": "sweep_positions"',
     ["test_cli.py::test_bad_input_exits_2_with_one_line"]),
    ("one_character_text", "7: a text of one character let through to training",
     "    if len(set(text)) < 2:", "    if len(set(text)) < 1:",
     ["test_cli.py::test_a_text_of_fewer_than_two_characters_is_refused_before_training"]),
    ("part_one_overclaimed", "8: the docstring says Part I trains when run",
     "text above the Part II banner imports alone, and its run_lesson is what --lesson_only runs.",
     "text above the Part II banner trains, samples and prints when run.",
     ["test_cli.py::test_the_text_above_the_part_ii_banner_is_what_the_docstring_says"]),
    ("frontier_loss_from_full", "9: a point's loss not from its own decoder (the verdict joined two plans)",
     'q = quality.get(name, quality.get(ref))', 'q = quality.get(ref)',
     ["test_frontier.py::test_every_point_of_the_frontier_is_measured_on_the_same_positions_and_workload"]),
    # 10 (the smaller model's depth rounded from test) has no code left to break: the frontier holds every
    # plain GPT a run trains, and none is chosen by early exit's depth
    ("same_masks_every_rank", "11: every rank drawing the same dropout masks",
     "    if rank > 0:\n        torch.manual_seed", "    if False:\n        torch.manual_seed",
     ["test_processes.py::test_each_process_draws_its_own_dropout_masks"]),
    ("resume_recipe_from_flags", "12: a resume taking the recipe from the command line's defaults",
     "setattr(config, name, saved)",
     "setattr(config, name, given if name in TRAINING_FIELDS else saved)",
     ["test_robustness.py::test_a_resume_keeps_the_checkpoints_recipe_and_names_what_the_command_line_changes"]),
    ("costs_on_an_empty_cache", "13: unit costs timed against an empty cache",
     "cache.lengths = [typical] * cfg.n_layer", "cache.lengths = [0] * cfg.n_layer",
     ["test_worth_it.py::test_unit_costs_are_timed_at_the_workloads_typical_cache_length"]),
    ("named_device_dropped", "14: a named device under torchrun let through",
     'if config.device not in ("auto", "cuda", "cpu"):', "if False:",
     ["test_processes.py::test_a_named_device_under_torchrun_is_honoured_or_refused"]),
    # what a fresh review of the change found, each put back
    ("batch_runs_unweighted", "a batch's block runs counted as if every row ran every call",
     "        return self.counted + sum(self.layer_evals) * self.k.size(1) / self.batch_size",
     "        return self.counted + sum(self.layer_evals)",
     ["test_batches.py::test_a_batch_counts_each_block_call_at_the_share_of_rows_it_ran"]),
    ("resume_old_hyperparameters", "a resume stepping with the checkpoint's weight decay and betas",
     '            saved.update(weight_decay=group["weight_decay"], betas=group["betas"])\n',
     "            pass\n",
     ["test_robustness.py::test_a_resume_trains_with_the_recipes_weight_decay_and_betas"]),
    ("no_rules_after_resume", "a resume that checks the rules against the default architecture only",
     "    validate(config)  # the rules that tie fields together, with the checkpoint's architecture\n", "",
     ["test_robustness.py::test_a_resume_checks_the_rules_again_with_the_checkpoints_architecture"]),
    ("depths_unchecked", "--depths deeper than the model let through to training",
     '(any(not 0 < int(d) <= L for d in re.findall(r"\\d+", config.depths)),', "(False,",
     ["test_robustness.py::test_the_rules_across_fields_hold_one_step_either_side"]),
    ("quality_piece_short", "a text too short for a prompt and a quality piece let through",
     "need = max(config.block_size, config.bench_prompt_len + config.bench_tokens) + 2",
     "need = max(config.block_size, config.bench_prompt_len) + 2",
     ["test_robustness.py::test_the_text_holds_a_prompt_and_a_quality_piece"]),
    ("summary_counts_a_frozen_decoder", "the frozen model's decoder named the fastest exact decoder of the exit model",
     'if e["cache"] == "exact" and e["name"] in DECODERS]', 'if e["cache"] == "exact" and e["family"] == "exit model"]',
     ["test_newcomer.py::test_summary_names_the_fastest_exact_decoder_of_the_exit_model_never_a_smaller_gpt"]),
    ("summary_counts_a_gpt", "a plain GPT named the fastest exact decoder of the exit model",
     'if e["cache"] == "exact" and e["name"] in DECODERS]', 'if e["cache"] == "exact"]',
     ["test_newcomer.py::test_summary_names_the_fastest_exact_decoder_of_the_exit_model_never_a_smaller_gpt"]),
    ("forecast_from_greedy", "every row's forecast read from val's greedy pass, whatever its mode",
     '    figures = {"predicted_speedup": val[row["name"], mode, None]["speedup"]}\n',
     '    figures = {"predicted_speedup": val[row["name"], "greedy", None]["speedup"]}\n',
     ["test_lean.py::test_each_strategy_row_carries_its_plans_prediction"]),
    ("models_never_on_val", "plain GPTs left out of val's pass, with no forecast to read",
     "more.items() if family != \"pruned\"}", "more.items() if False}",
     ["test_lean.py::test_each_strategy_row_carries_its_plans_prediction",
      "test_frontier.py::test_every_point_of_the_frontier_is_measured_on_the_same_positions_and_workload"]),
    ("val_workload_as_small", "val's workload no larger than test's, its sampled forecasts noisier",
     '(("val", 2), ("test", 1))]', '(("val", 1), ("test", 1))]',
     ["test_batches.py::test_val_times_each_drafter_at_each_k_beside_full_depth"]),
    ("threshold_one_checks_an_exit", "a plan at threshold 1 that names an exit it never checks",
     "    if threshold >= 1 or checked is not None:\n        return priced([] if threshold >= 1 else checked)\n",
     "    if checked is not None:\n        return priced(checked)\n",
     ["test_workload.py::test_a_plan_given_or_at_threshold_one_is_not_searched"]),
    ("search_stops_at_one_exit", "a plan search that stops after its first exit, never pricing two",
     "    for _ in range(len(records.pred) - 1):\n", "    for _ in range(1):\n",
     ["test_workload.py::test_the_plan_is_the_fastest_plan_of_a_greedy_search"]),
    ("weights_without_derived", "state_copy's memory without the projections it folds and reads",
     "read = [*model.parameters(), *(d.derived(model) if d.derived else ())]", "read = [*model.parameters()]",
     ["test_frontier.py::test_memory_is_read_from_the_tensors_a_decoder_holds"]),
    ("sample_threshold_calibrated", "skipdecode's sample reported at the calibrated threshold",
     'return build(name, lab.model, plan, lab.rules), label, plan.get("threshold")',
     "return build(name, lab.model, plan, lab.rules), label, lab.threshold",
     ["test_newcomer.py::test_the_sample_reports_the_threshold_its_decoder_ran_at"]),
    ("json_before_page", "report.json written before its page is made",
     '    page = html_report(report)  # first: a page that fails to render writes neither file\n'
     '    write_text(json.dumps(report, indent=2), path + ".json")\n',
     '    write_text(json.dumps(report, indent=2), path + ".json")\n    page = html_report(report)\n',
     ["test_robustness.py::test_a_page_that_fails_to_render_writes_neither_file"]),
    ("gpu_not_current", "a named GPU left as not the current one",
     '    if name.startswith("cuda:"):\n        torch.cuda.set_device(name)\n', "",
     ["test_processes.py::test_a_named_gpu_becomes_the_current_one"]),
    ("quality_from_position_0", "the tables' quality read from window position 0, not after the workload's prompt",
     "                                  config.bench_prompt_len, config.bench_tokens)",
     "                                  1, config.bench_tokens)",
     ["test_figures.py::test_the_decoder_tables_read_quality_after_the_workloads_prompt"]),
    ("threshold_two_decimals", "a calibrated 0.996 printed as 1.00", "| thr       | {:.3g}  |", "| thr       | {:.2f}  |",
     ["test_figures.py::test_the_strategies_table_prints_the_calibrated_threshold_as_calibrated"]),
    ("approximate_quality_batched", "an approximate cache's quality decoded a whole batch of pieces at once, deeper than at batch 1",
     'DECODERS[decoder].cache != "exact" else 128,',
     'DECODERS[decoder].cache == "exact" else 128,',
     ["test_figures.py::test_the_decoder_tables_read_quality_after_the_workloads_prompt"]),
    ("notes_count_asked", "notes that name the positions asked for, not those recorded",
     'return f"{lab.records[split].targets.numel():,}"', 'return f"{lab.config.sweep_positions:,}"',
     ["test_figures.py::test_a_notes_position_count_is_what_was_recorded_not_what_was_asked"]),
    ("backfill_priced_as_skipping", "backfill priced as if it skipped the blocks it runs for the cache",
     "+ decoder.skips * counts[\"skipped\"] * costs[\"block\"])", "+ counts[\"skipped\"] * costs[\"block\"])",
     ["test_workload.py::test_a_plans_price_by_hand", "test_figures.py::test_a_plans_price_by_hand"]),
    ("draft_models_exit_is_self", "the draft model's row recorded with self-speculation's draft_exit",
     '{"draft_exit": draft.config.n_layer - 1,', '{"draft_exit": config.draft_exit,',
     ["test_frontier.py::test_every_point_of_the_frontier_is_measured_on_the_same_positions_and_workload"]),
    ("lesson_only_takes_lab_flags", "--lesson_only that silently ignores --kv_strategy, --depths and --bench_batch",
     "(config.lesson_only and any(getattr(config, name)", "(False and any(getattr(config, name)",
     ["test_robustness.py::test_the_rules_across_fields_hold_one_step_either_side"]),
    # the fair trial: heads on a frozen trunk, the recipe's cost, each point against its own reference
    ("trunk_not_frozen", "exit heads trained with the plain GPT's trunk left trainable",
     "    model.requires_grad_(not frozen)\n", "    model.requires_grad_(True)\n",
     ["test_frozen.py::test_the_trunk_and_final_head_are_unchanged_and_only_the_heads_learn"]),
    ("whole_model_trained", "the plain GPT's trunk trained with the heads",
     "    model.requires_grad_(not frozen)\n    model.exit_heads.requires_grad_(True)\n"
     "    optimizer = configure_optimizer(model.exit_heads if frozen else model, config)\n",
     "    optimizer = configure_optimizer(model, config)\n",
     ["test_frozen.py::test_the_trunk_and_final_head_are_unchanged_and_only_the_heads_learn",
      "test_frozen.py::test_full_depth_is_the_plain_gpts_bit_for_bit"]),
    ("frozen_heads_with_dropout", "frozen heads trained on states the decoder never sees (dropout on)",
     "replace(config, dropout=0.0, layer_dropout=0.0, alpha", "replace(config, alpha",
     ["test_frozen.py::test_the_trunk_and_final_head_are_unchanged_and_only_the_heads_learn"]),
    ("frozen_heads_without_loss", "frozen heads at the run's alpha 0: backward has nothing to differentiate",
     "alpha=config.alpha or\n", "alpha=config.alpha or 0 *\n",
     ["test_frozen.py::test_frozen_heads_learn_even_where_the_run_trains_no_exit"]),
    ("frozen_at_a_process_batch", "frozen heads at one process's batch under torchrun",
     "batch_size=config.batch_size * world), splits, frozen=True)",
     "batch_size=config.batch_size), splits, frozen=True)",
     ["test_frozen.py::test_frozen_heads_learn_even_where_the_run_trains_no_exit"]),
    ("frozen_with_joint_plans", "the frozen model's decoders run at the exit model's plans",
     '        plans = self.plans_for(records, run_threshold(self.config, sampling), sampling["schedule"])\n',
     "        plans = self.plans\n",
     ["test_frozen.py::test_the_plain_gpt_of_its_depth_and_the_frozen_model_join_every_table_and_the_recipe_has_a_cost"]),
    ("frozen_at_joint_threshold", "the frozen model's plans at the exit model's calibrated threshold",
     '        plans = self.plans_for(records, run_threshold(self.config, sampling), sampling["schedule"])\n',
     '        plans = self.plans_for(records, self.threshold, sampling["schedule"])\n',
     ["test_frozen.py::test_the_plain_gpt_of_its_depth_and_the_frozen_model_join_every_table_and_the_recipe_has_a_cost"]),
    ("recipe_cost_reversed", "the recipe's cost taken the wrong way round",
     '"recipe_cost": loss["full"] - loss[deep],', '"recipe_cost": loss[deep] - loss["full"],',
     ["test_frozen.py::test_the_plain_gpt_of_its_depth_and_the_frozen_model_join_every_table_and_the_recipe_has_a_cost"]),
    ("frozen_against_joint", "a frozen decoder's output compared with the exit model's full depth, not its own",
     "    return [table_row(name, decoders[name][0], decoders[name][2], mode, speed, quality,",
     '    return [table_row(name, decoders[name][0], "full", mode, speed, quality,',
     ["test_frozen.py::test_the_plain_gpt_of_its_depth_and_the_frozen_model_join_every_table_and_the_recipe_has_a_cost"]),
    # the command line's bounds and the divergence check, each put back
    ("seed_at_torchs_bound", "a seed bounded at torch's 2**64 - 1, leaving no room for seed + 1",
     '"[0, 4294967295]": "seed",', '"[0, 18446744073709551615]": "seed",',
     ["test_cli.py::test_a_bound_holds_one_step_either_side_and_is_said_before_any_work"]),
    ("num_draft_off_by_one", "num_draft allowed one past block_size",
     "(config.num_draft > config.block_size and L < math.inf,",
     "(config.num_draft > config.block_size + 1 and L < math.inf,",
     ["test_cli.py::test_a_bound_holds_one_step_either_side_and_is_said_before_any_work"]),
    ("num_draft_against_default_block", "a resume's num_draft checked against block_size's default",
     'validate(config, math.inf if config.init_from == "resume" else None)',
     'validate(config, math.inf if config.init_from == "resume" and "n_layer" not in given '
     'else None)',
     ["test_cli.py::test_a_resume_checks_num_draft_against_the_checkpoints_block_size"]),
    ("tiny_temperature_through", "a temperature so small that logits / it overflow let through",
     "(0 < config.temperature < 1e-6,", "(False,",
     ["test_cli.py::test_a_bound_holds_one_step_either_side_and_is_said_before_any_work"]),
    ("no_divergence_check", "a diverged model's nan probabilities handed to the sampler",
     '    if not math.isfinite(losses["val"][-1]):\n        raise ValueError(f"training diverged',
     '    if False:\n        raise ValueError(f"training diverged',
     ["test_cli.py::test_a_diverged_run_ends_in_one_line"]),
    ("speedup_every_call", "a speed-up from every call's ratio: a burst of load on one call kept",
     "    cut = len(ratios) // 4\n", "    cut = 0\n",
     ["test_strategies.py::test_a_speed_up_pairs_each_call_with_full_depths_and_averages_the_middle_half"]),
    ("pruned_on_val", "pruned models timed on val though no table shows their forecast",
     'more.items() if family != "pruned"}', 'more.items()}',
     ["test_frontier.py::test_every_point_of_the_frontier_is_measured_on_the_same_positions_and_workload",
      "test_lean.py::test_each_strategy_row_carries_its_plans_prediction"]),
    ("se_over_positions", "the paired error taken over positions, as if a piece's characters were independent",
     "(x - y).view(-1, piece).mean(1).std() / (len(x) // piece) ** 0.5", "(x - y).std() / len(x) ** 0.5",
     ["test_worth_it.py::test_a_paired_error_is_the_spread_of_the_pieces_mean_differences_over_root_n"]),
    ("beaten_within_the_error", "a faster point marked as beating another whose loss it is within twice the error of",
     "return faster >= 0 and margin > 2 * error or", "return faster >= 0 and margin > 0 or",
     ["test_worth_it.py::test_a_faster_point_beats_only_beyond_twice_the_paired_error_of_the_loss_difference"]),
    ("continued_replays_batches", "the continued model's recipe stage replaying the plain stage's first batches",
     "                   seed=config.seed + 1)", "                   seed=config.seed)",
     ["test_frozen.py::test_the_continued_split_of_steps_rounds_to_the_nearest"]),
    ("continued_empty_stage", "a --continued share that leaves a stage no step let through",
     "(config.continued and not 0 < round(", "(False and not 0 < round(",
     ["test_robustness.py::test_continued_needs_a_step_in_each_stage"]),
    ("early_exit_off_the_frontier", "the summary naming self-speculation as early exit on the frontier when it is beaten",
     'p["decoder"]].drafter == "exit") and None in (p["dominated_greedy"],',
     'p["decoder"]].drafter == "exit") and None not in (p["dominated_greedy"],',
     ["test_newcomer.py::test_the_summary_names_the_frontier_from_its_rows"]),
    ("frozen_every_decoder", "the default run's frozen model timing every decoder, past the run's time",
     "if cfg.continued or DECODERS[name].cache", "if True or DECODERS[name].cache",
     ["test_worth_it.py::test_compare_every_depth_as_points_of_the_frontier"]),
    ("frozen_schedule_too", "the default run's frozen model timing SkipDecode's schedule too",
     '== "exact" and DECODERS[name].skips and not DECODERS[name].schedule])',
     '== "exact" and DECODERS[name].skips])',
     ["test_worth_it.py::test_compare_every_depth_as_points_of_the_frontier"]),
    ("frozen_backfill_too", "the default run's frozen model timing backfill, which skips nothing, too",
     '== "exact" and DECODERS[name].skips and not DECODERS[name].schedule])',
     '== "exact" and not DECODERS[name].schedule])',
     ["test_worth_it.py::test_compare_every_depth_as_points_of_the_frontier"]),
    ("heads_every_step", "the frozen model's heads trained for every step of the run, past the run's time",
     "max_iters=config.max_iters // 2,", "max_iters=config.max_iters,",
     ["test_frozen.py::test_the_trunk_and_final_head_are_unchanged_and_only_the_heads_learn"]),
    ("one_fixed_order", "timed calls in one fixed order, each decoder after the same one every time",
     "for key, decode in order.sample(list(decoders.items()), len(decoders)):",
     "for key, decode in decoders.items():",
     ["test_strategies.py::test_speed_pass_interleaves_the_decoders_a_call_at_a_time_in_a_new_order_each_time"]),
    ("moving_target_epsilon", "a moving threshold aiming at epsilon itself, so its slack breaks epsilon",
     "        self.target = config.epsilon - (self.credit + climb + batch) / config.adapt_horizon",
     "        self.target = config.epsilon",
     ["test_moving.py::test_the_bound_holds_at_the_horizon_on_the_worst_stream_and_not_before_it",
      "test_moving.py::test_a_jump_to_three_epsilon_raises_the_threshold_and_the_rate_comes_back"]),
    ("moving_batch_ignored", "a monitor of many rows whose target leaves room for one row's disagreement",
     "(self.credit + climb + batch) / config.adapt_horizon", "(self.credit + climb + 1) / config.adapt_horizon",
     ["test_moving.py::test_a_monitor_for_a_batch_keeps_its_bound_when_a_step_brings_every_rows_disagreement"]),
    ("moving_no_credit", "a moving threshold that starts with no credit and banks none",
     "        self.u = max(self.u + k - n * self.target, -2 * self.credit)",
     "        self.u = max(self.u + k - n * self.target, 0)",
     ["test_moving.py::test_on_streams_like_its_calibration_the_threshold_stays_unless_epsilon_broke_there"]),
    ("moving_never_full_depth", "a moving threshold that never reaches full depth",
     "return round(self.start * (1 - min(max(self.u, 0) / self.climb, 1)))",
     "return round(self.start * (1 - min(max(self.u, 0) / self.climb, 0.9)))",
     ["test_moving.py::test_the_bound_holds_at_the_horizon_on_the_worst_stream_and_not_before_it"]),
    ("bounds_alpha_unsplit", "a confidence sequence whose bets each take all of alpha",
     "    a = math.log(2 * len(bets) / alpha)", "    a = math.log(1 / alpha)",
     ["test_moving.py::test_the_bounds_are_the_tightest_of_their_bets_one_step_either_side"]),
    ("bounds_upper_slope", "an upper bound built with the lower bound's slope: too low",
     "(b * k + a) / -math.expm1(-b)", "(b * k + a) / math.expm1(b)",
     ["test_moving.py::test_the_bounds_hold_at_every_position_under_shift",
      "test_moving.py::test_the_bounds_are_the_tightest_of_their_bets_one_step_either_side"]),
    ("spot_unweighted", "spot checks whose disagreements count once, not 1 / share",
     "        m.update(k / (self.share or 1), len(left))", "        m.update(k, len(left))",
     ["test_moving.py::test_spot_checks_label_their_share_and_keep_epsilon"]),
    ("spot_runs_nothing", "a spot check that runs no layer above the exit: its label is a stale state's",
     "        if self.spot:  # the layers above run", "        if False:  # the layers above run",
     ["test_moving.py::test_a_spot_check_on_every_step_is_backfill"]),
    ("backfill_spot_checked", "a watched backfill that labels only a share of its exits, though it runs them all",
     "config.spot_share if d.skips else 1.0", "config.spot_share",
     ["test_moving.py::test_a_watched_backfill_leaves_where_the_moving_rule_does_on_the_records"]),
]


def scratch_copy():
    """The script, the tests, the texts and the words the tests read, in a folder of their own."""
    folder = tempfile.mkdtemp(prefix="mistake-")
    for name in ("nanogpt_exit_head.py", "input.txt", "shift.txt", "README.md", "requirements.txt"):
        shutil.copy(os.path.join(ROOT, name), folder)
    for name in ("tests", "docs", ".ci"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(folder, name),
                        ignore=shutil.ignore_patterns("__pycache__", "mistakes.py"))
    return folder


def failing(folder, tests):
    """The tests that fail in folder: those of `tests` that pytest reports failed."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                           *[f"tests/{t}" for t in tests]], cwd=folder, capture_output=True, text=True)
    return sorted({line.split()[1].split("[")[0] for line in proc.stdout.splitlines()
                   if line.startswith("FAILED ")}), proc.returncode


def main(names):
    chosen = [mk for mk in MISTAKES if not names or mk[0] in names]
    clean = scratch_copy()
    failed, rc = failing(clean, sorted({t for *_, tests in chosen for t in tests}))
    shutil.rmtree(clean)
    if rc:
        print(f"the unedited copy fails: {failed or rc}")
        return 1
    missed = 0
    for name, what, old, new, tests in chosen:
        folder = scratch_copy()
        path = os.path.join(folder, "nanogpt_exit_head.py")
        source = open(path, encoding="utf-8").read()
        assert source.count(old) == 1, f"{name}: the text to change is not in the script exactly once"
        open(path, "w", encoding="utf-8").write(source.replace(old, new))
        caught, _ = failing(folder, tests)
        shutil.rmtree(folder)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {name:28} {what}" + (f"\n        by {', '.join(caught)}" if caught else ""))
    print(f"{len(chosen) - missed} of {len(chosen)} mistakes caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
