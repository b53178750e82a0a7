"""Push delivery's consumer: ``HiddenStatesReader`` grants producers pages of its pool,
checks each share as it is WRITTEN there and hands samples out, with its ledger."""
