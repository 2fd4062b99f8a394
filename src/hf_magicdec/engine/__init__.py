"""The engine: the loop (:mod:`.loop`), the draft and verify steps (:mod:`.steps`), who drafts
(:mod:`.drafters`), what watches (:mod:`.observers`), γ policies (:mod:`.gamma`), the cache (:mod:`.cache`), the ``magicdec``
attention (:mod:`.attention`), token choice (:mod:`.sampling`), ragged rows (:mod:`.ragged`,
:mod:`.stopping`), outputs, validation, view refresh and prefill sharing."""
