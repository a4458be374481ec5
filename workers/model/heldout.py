"""The held-out parity set: texts no forward path was tuned on, the gate every path must pass.

A copy that was calibrated on some texts (the int8 copy's SmoothQuant ranges come from
:data:`~embedfleet.workers.model.precision.PROBE_TEXTS`) can match float32 on those texts and
drift on others: measured, the W8A8 copy passed on its 20 probe texts and fell below the mean bar on
unseen multilingual (0.99869), long (0.99859) and odd inputs (0.99722, min 0.99483). So each
forward path the worker may choose (bf16, the int8 copies) is held to the bar on this fixed set,
disjoint from every calibration text, shipped in the package so every worker checks the same.

Three groups, each where reduced precision fails first:

- :data:`MULTILINGUAL`: many scripts and languages (rare vocabulary pieces, unusual embeddings);
- :data:`LONG`: passages near and over the model's limit (long sums in attention and pooling);
- :data:`ODD`: the inputs real traffic has and prose lacks (markup, logs, identifiers, emoji,
  repeated tokens, a lone character, whitespace runs).

``tests/integration/workers/test_int8.py`` checks that the set stays disjoint from the calibration
texts.
"""

from __future__ import annotations

MULTILINGUAL: tuple[str, ...] = (
    "Le conseil municipal a voté le budget après trois heures de débat animé.",
    "¿Dónde está la estación de tren más cercana? Necesito llegar antes de las ocho.",
    "Die Bibliothek bleibt wegen Renovierungsarbeiten bis Ende März geschlossen.",
    "Il treno per Milano è in ritardo di venti minuti a causa di un guasto tecnico.",
    "O relatório trimestral mostra um crescimento de quatro por cento nas vendas.",
    "Метеорологи предупреждают о сильном снегопаде в северных районах страны.",
    "يتوقع الخبراء ارتفاع أسعار القمح بسبب موجة الجفاف الأخيرة.",
    "मानसून की पहली बारिश ने शहर की गर्मी से लोगों को राहत दी।",
    "新しい図書館は駅から歩いて五分のところにあり、週末も開いています。",
    "这家餐厅的招牌菜是红烧肉，每天中午都有很多人排队。",
    "서울의 지하철은 깨끗하고 정확해서 관광객들에게 인기가 많다.",
    "Η ομάδα κέρδισε τον τελικό με ένα γκολ στο τελευταίο λεπτό.",
    "Yarın sabah erkenden yola çıkacağız, o yüzden bu gece valizleri hazırlayalım.",
    "Chính phủ đã công bố kế hoạch mở rộng mạng lưới đường sắt cao tốc.",
    "Pani Zofia codziennie rano karmi gołębie w parku koło ratusza.",
    "הפגישה נדחתה ליום חמישי בגלל מחלה של אחד המשתתפים.",
    "ข่าวดีสำหรับนักท่องเที่ยว สนามบินจะเปิดอาคารผู้โดยสารใหม่ในเดือนหน้า",
    "Tämä kirja kertoo pienen kylän elämästä sodan jälkeisinä vuosina.",
    "Kwa sababu ya mvua kubwa, barabara kuu imefungwa kwa muda.",
    "The meeting (la réunion, die Besprechung, 会議) starts at 9:00 CET.",
)

LONG: tuple[str, ...] = (
    "Lighthouses were once tended by keepers who lived at the foot of the tower with their "
    "families, trimming wicks, polishing lenses and winding the clockwork that turned the "
    "light through the night. A Fresnel lens gathers the light of a small flame or lamp into "
    "a narrow beam with concentric rings of glass prisms, which made the beam visible many "
    "miles out to sea while using far less oil than the mirrors it replaced. Each station had "
    "its own signature, a pattern of flashes and eclipses printed on nautical charts, so a "
    "navigator who counted the seconds between flashes could tell which headland lay ahead. "
    "Fog signals complemented the light: bells, guns, sirens and later diaphones whose low "
    "groan carried across miles of water. Automation in the twentieth century replaced the "
    "keepers with electric lamps, timers and sensors, and many of the old dwellings are now "
    "museums, guest houses or simply empty, while the lights themselves still turn.",
    "To make a sourdough loaf, refresh the starter the evening before so that it is active and "
    "bubbly by morning. Mix flour and water and let them rest for half an hour; this "
    "autolyse lets the flour hydrate and the gluten begin to form without any kneading. Add "
    "the starter and salt, then fold the dough over itself every thirty minutes for the "
    "first two hours, stretching one side up and over the rest and turning the bowl a "
    "quarter turn each time. Once the dough has grown by about half and shows bubbles on "
    "its sides, shape it into a tight round, place it seam side up in a floured basket and "
    "leave it in the refrigerator overnight. Bake it in a preheated covered pot at a high "
    "temperature, removing the lid after twenty minutes so that the crust can darken, and "
    "let the loaf cool completely before cutting, or the crumb will be gummy. Flour, water, "
    "salt and time: every other variation is a matter of taste and of the kitchen's warmth.",
    "Incident report. At 02:14 the primary database node stopped answering health checks "
    "after its disk filled with write-ahead log segments that the archiver had failed to "
    "ship for six hours, because a credential for the object store had expired the previous "
    "afternoon. The replica was promoted automatically at 02:16, but two application "
    "services kept connecting to the old address from a cached DNS entry and returned errors "
    "for eleven minutes, until their pods were restarted by hand. No committed data was lost: "
    "the replica had applied every segment up to the failure. Follow-up actions: alert on the "
    "age of the oldest unarchived segment rather than on disk usage alone, rotate the store's "
    "credentials through the secrets manager with an expiry warning a week ahead, lower the "
    "DNS cache lifetime in the client library to thirty seconds, and rehearse a failover "
    "every month on the staging cluster, with the on-call engineer reading from the runbook.",
    "La Révolution industrielle commence en Grande-Bretagne à la fin du dix-huitième siècle, "
    "lorsque la machine à vapeur, améliorée par James Watt, permet d'actionner les métiers à "
    "tisser et les pompes des mines de charbon. Les villes grandissent rapidement autour des "
    "usines, attirant des paysans qui quittent les campagnes à la recherche d'un salaire. Les "
    "conditions de travail sont dures: journées de quatorze heures, enfants employés dans les "
    "filatures, logements insalubres. Au dix-neuvième siècle, le chemin de fer transforme le "
    "commerce et la vie quotidienne, en réduisant à quelques heures des voyages qui prenaient "
    "des jours. Peu à peu, des lois limitent le travail des enfants, des syndicats se forment "
    "et l'école devient obligatoire, tandis que l'industrialisation gagne la France, la "
    "Belgique, l'Allemagne puis le reste du monde, avec ses progrès et ses fractures sociales.",
    "量子计算机利用量子比特的叠加和纠缠来处理信息。与经典比特只能表示零或一不同，量子比特可以同时"
    "处于两种状态的叠加之中，这使得某些问题的计算速度可能大大提高，例如大整数的因式分解和分子结构的"
    "模拟。然而，量子比特非常脆弱，容易受到温度、电磁噪声和材料缺陷的干扰而失去相干性，因此大多数"
    "量子计算机需要在接近绝对零度的环境中运行。研究人员正在开发纠错码，用许多物理量子比特来编码一个"
    "逻辑量子比特，以便在出错时进行纠正。目前的设备仍然处于所谓的含噪声中等规模量子阶段，距离真正"
    "通用、容错的量子计算机还有很长的路要走，但在化学、材料科学和优化问题上已经出现了一些有希望的"
    "实验结果。各国政府和大型科技公司都在这一领域投入了大量资金，希望在未来的竞争中占据先机。",
    'class LeakyBucket:\n    """Admit requests at a steady rate, absorbing short bursts."""\n\n'
    "    def __init__(self, rate: float, capacity: int) -> None:\n"
    "        self.rate = rate\n        self.capacity = capacity\n        self.level = 0.0\n"
    "        self.updated = time.monotonic()\n\n"
    "    def admit(self, cost: float = 1.0) -> bool:\n        now = time.monotonic()\n"
    "        self.level = max(0.0, self.level - (now - self.updated) * self.rate)\n"
    "        self.updated = now\n        if self.level + cost > self.capacity:\n"
    "            return False\n        self.level += cost\n        return True\n\n\n"
    "def throttled(bucket: LeakyBucket, calls: list[Callable[[], None]]) -> int:\n"
    "    done = 0\n    for call in calls:\n        while not bucket.admit():\n"
    "            time.sleep(1 / bucket.rate)\n        call()\n        done += 1\n"
    "    return done\n",
    # over the limit (the truncated path), two different passages run together
    "The committee reviewed forty-two applications for the spring research grants and "
    "funded eleven of them, favouring projects with a clear plan for sharing their data and "
    "code. Reviewers noted that many proposals underestimated the cost of field work and of "
    "the staff needed to clean and document a dataset before it can be published. Next year "
    "the call will ask for a data management plan of one page, reviewed separately, and for "
    "a budget line for archiving. Successful applicants will present their progress at the "
    "autumn symposium, where a poster session replaces the short talks of previous years. "
    "Meanwhile the river survey team reported that water temperatures at the upstream "
    "stations rose by almost two degrees over the decade, that two species of mayfly have "
    "not been recorded since the dam was raised, and that the new fish ladder is used by "
    "trout but not yet by the eels it was built for; sensors will be added below the weir "
    "to see whether the eels gather there in the autumn, and volunteers from the angling "
    "club have offered to check the traps every week through the winter months, logging "
    "counts, lengths and the water level on a shared sheet that the team reviews monthly.",
)

ODD: tuple[str, ...] = (
    "a",
    "?",
    "    leading and trailing spaces    ",
    "line one\n\n\n\tline two after tabs\r\nline three",
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "la la la la la la la la la la la la la la la la la la la la la la la la la la",
    "🚀🔥💯 launch day!!! 🎉🎉🎉 thanks everyone 🙏",
    '<div class="card"><h2>Title</h2><p>Body &amp; more&nbsp;text</p></div>',
    '{"user_id": 48213, "tags": ["beta", "eu-west"], "active": true, "score": null}',
    "2026-03-14T09:26:53.589Z WARN [pool-3-thread-7] c.e.s.Retry - attempt 4/5 failed: "
    "java.net.SocketTimeoutException: Read timed out",
    "Traceback (most recent call last):\n  File \"app.py\", line 12, in <module>\nKeyError: 'LANG'",
    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "dGhpcyBpcyBub3QgYSBzZWNyZXQsIGp1c3QgYmFzZTY0IHRleHQ=",
    "00 1f 8b 08 00 00 00 00 00 03 ed 5a 6d 73 db 36 12 fe ce 5f 81",
    "getUserByIdOrThrow(userId: string): Promise<UserRecord | never>",
    "WHY IS THE BUILD RED AGAIN ON MAIN",
    "zero\u200bwidth\u200bspaces and a soft\u00adhyphen",
    "x² + y² = r²; ∑ᵢ aᵢ ≤ ∞; ∀ε>0 ∃δ>0",
    "C:\\Users\\admin\\AppData\\Local\\Temp\\~$report (final) v2.docx",
    "+1 (555) 010-9999 ext. 42 / fax +44 20 7946 0000",
    "ℌ𝔢𝔩𝔩𝔬 𝔴𝔬𝔯𝔩𝔡 — 𝐛𝐨𝐥𝐝 𝑖𝑡𝑎𝑙𝑖𝑐",
    "||| --- ::: ;;; ,,, ... ___ ~~~ ^^^ ***",
)

HELDOUT_TEXTS: tuple[str, ...] = MULTILINGUAL + LONG + ODD
"""Every held-out text, in the groups' order (multilingual, long, odd)."""

GROUPS: dict[str, tuple[str, ...]] = {"multilingual": MULTILINGUAL, "long": LONG, "odd": ODD}
