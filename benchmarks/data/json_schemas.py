"""Twenty JSON schemas with ten user prompts each: the inputs of the structured-output benchmark.

They look like what users send as OpenAI's `response_format: json_schema` (records, listings, triage
results, nested objects, arrays of objects, enums), written for this benchmark because no package ships
JSONSchemaBench on PyPI. Every string has a maxLength, every array a maxItems, every integer bounds and
every amount of money a multipleOf 0.01, so that a small model cannot write forever; only features llguidance compiles are used.

    from data.json_schemas import CASES, requests
    for case, prompt in requests():   # 200 pairs, schema-major order
        ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DATE = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
TIME = "^[0-9]{2}:[0-9]{2}$"


def text(max_length: int = 80, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict[str, Any]:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def money(minimum: float, maximum: float) -> dict[str, Any]:
    """An amount in cents, as payment APIs write it: multipleOf bounds the fraction digits, which a plain JSON
    number leaves open (a small model can write 120.000000000000012000... until the token cap)."""
    return {**number(minimum, maximum), "multipleOf": 0.01}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def obj(properties: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A closed object whose properties are all required except those named in `optional`."""
    return {"type": "object", "properties": properties,
            "required": [k for k in properties if k not in optional], "additionalProperties": False}


def schema(properties: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **obj(properties, optional)}


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompts: tuple[str, ...]  # 10 each


ADDRESS = obj({
    "street": text(80),
    "city": text(50),
    "region": text(50),
    "postal_code": {"type": "string", "pattern": "^[A-Z0-9 -]{3,10}$"},
    "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
}, optional=("region",))

CURRENCY = enum("USD", "EUR", "GBP", "JPY", "CAD", "AUD", "CHF")

CASES: tuple[SchemaCase, ...] = (
    SchemaCase("person", schema({
        "full_name": text(60),
        "age": integer(0, 120),
        "email": {"type": "string", "pattern": "^[a-z0-9._-]{1,30}@[a-z0-9-]{1,30}\\.[a-z]{2,6}$"},
        "occupation": text(60),
        "languages": array(text(30), 4, 1),
        "is_employed": {"type": "boolean"},
    }), (
        "Extract the person: Maria Lopez, 34, maria.lopez@example.com, a nurse who speaks Spanish and English and works full time.",
        "Create a record for Tom Becker, a 71-year-old retired engineer (tom.b@mail.de) who speaks German.",
        "Invent a plausible person record for a young software developer living in Lagos.",
        "Parse this: 'Hi, I'm Aiko Tanaka, 28, translator, fluent in Japanese, French and English, aiko@tanaka.jp, currently between jobs.'",
        "Make a person record for a 19-year-old student called Liam O'Brien whose email is liam.ob@uni.ie and who speaks Irish and English.",
        "Extract the contact from this signature: 'Dr. Priya Nair, Cardiologist, priya.nair@hospital.in, 45, speaks Hindi, Malayalam, English'.",
        "Give me a made-up person record for a chef from Lyon in his fifties.",
        "Turn 'Sven Olsen, 52, fisherman, sven@fjord.no, Norwegian only, employed' into a person record.",
        "Record the details of Grace Kim, a 38-year-old unemployed architect who speaks Korean and English, at grace.kim@example.org.",
        "Invent a person record for an elderly polyglot librarian.",
    )),
    SchemaCase("product_listing", schema({
        "title": text(80),
        "brand": text(40),
        "category": enum("electronics", "clothing", "home", "toys", "sports", "books", "beauty", "grocery"),
        "price": obj({"amount": money(0, 100000), "currency": CURRENCY}),
        "in_stock": {"type": "boolean"},
        "tags": array(text(20), 5),
        "rating": number(0, 5),
    }), (
        "List this product: Sony WH-1000XM5 wireless headphones, $349, in stock, rated 4.7 stars.",
        "Create a listing for a blue cotton t-shirt by Uniqlo priced at 14.90 EUR, currently sold out.",
        "Invent a product listing for a premium yoga mat.",
        "Extract the listing: 'LEGO Star Wars Millennium Falcon 75257 - 169.99 USD - available - 4.9/5 - tags: lego, starwars, building'.",
        "Make a listing for a paperback edition of 'Dune' costing 9.99 GBP with a 4.5 rating.",
        "Write a product listing for a stainless steel French press from Bodum, 39 CAD, in stock.",
        "Invent a grocery product listing for organic olive oil from a small Greek brand.",
        "Parse: 'Garmin Forerunner 265 running watch, CHF 449, out of stock, avg rating 4.6, tags gps, running, fitness'.",
        "Create a listing for an anti-aging face serum by The Ordinary priced at 12 AUD.",
        "Describe a made-up smart home thermostat as a product listing.",
    )),
    SchemaCase("calendar_event", schema({
        "title": text(80),
        "date": {"type": "string", "pattern": DATE},
        "start_time": {"type": "string", "pattern": TIME},
        "duration_minutes": integer(5, 600),
        "location": text(80),
        "attendees": array(text(40), 5),
        "recurrence": enum("none", "daily", "weekly", "monthly", "yearly"),
        "reminder_minutes_before": integer(0, 1440),
    }), (
        "Schedule a team standup on 2024-06-03 at 09:30 for 15 minutes in Room 4B with Ana and Raj, repeating daily.",
        "Add my dentist appointment on 2025-01-17 at 14:00, one hour, at Smile Clinic, remind me a day before.",
        "Create an event for Mom's birthday dinner on 2024-11-09 at 19:00 at Luigi's, yearly, with Dad and Sara.",
        "Invent a calendar event for a quarterly planning offsite.",
        "Parse: 'Book club - Thu 2024-05-16 18:30-20:00 @ Central Library, monthly, attendees: Kim, Leo, Ada'.",
        "Put a 45-minute weekly 1:1 with my manager Jordan on 2024-09-02 at 10:00 on Zoom.",
        "Create an event for a 5k charity run on 2024-10-06 at 08:00 in Riverside Park, lasting two hours.",
        "Make up a calendar entry for a product launch webinar.",
        "Add 'Flight to Boston' on 2025-03-22 at 06:15, 3 hours 20 minutes, from JFK Terminal 4, remind me 2 hours before.",
        "Schedule a one-off 30-minute code review session on 2024-07-11 at 16:00 with Mei and Tomas in the small meeting room.",
    )),
    SchemaCase("invoice", schema({
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
        "issue_date": {"type": "string", "pattern": DATE},
        "due_date": {"type": "string", "pattern": DATE},
        "seller": text(60),
        "buyer": text(60),
        "currency": CURRENCY,
        "line_items": array(obj({
            "description": text(80),
            "quantity": integer(1, 1000),
            "unit_price": money(0, 100000),
        }), 5, 1),
        "tax_rate_percent": money(0, 30),
        "total": money(0, 1000000),
    }), (
        "Create invoice INV-1042 from Acme Corp to Globex dated 2024-04-01, due 2024-05-01, for 3 widgets at $20 each with 8% tax.",
        "Extract the invoice: 'INV-20931, Bright Design Studio bills Nordic Foods 1,200 EUR for logo design and 2x 300 EUR for brand guidelines, 19% VAT, issued 2024-02-12, due 2024-03-12'.",
        "Invent an invoice from a freelance photographer to a wedding couple.",
        "Make an invoice INV-5555 from CloudHost Ltd to Pixel Games for 12 months of server hosting at 99 GBP, 20% tax, issued 2024-01-31 due 2024-02-29.",
        "Write an invoice for a plumbing job: 2 hours of labour at 85 USD and one replacement valve at 42 USD, no tax.",
        "Invent an invoice from a bakery to a café for a week of bread deliveries.",
        "Parse: 'Invoice INV-00077 / 2023-12-05 / due 2024-01-04 / Seller: Tanaka Print / Buyer: City Museum / 500 posters @ 120 JPY / tax 10%'.",
        "Create an invoice from a translation agency to a law firm for translating 4 contracts at 350 CHF each with 7.7% tax.",
        "Invoice a customer for 10 hours of consulting at 150 CAD per hour plus a 50 CAD travel fee, 13% tax.",
        "Invent an invoice for a small web agency's monthly maintenance retainer.",
    )),
    SchemaCase("issue_triage", schema({
        "title": text(100),
        "labels": array(enum("bug", "feature", "documentation", "performance", "security", "question", "regression"), 3, 1),
        "priority": enum("P0", "P1", "P2", "P3"),
        "component": enum("api", "cli", "ui", "database", "build", "docs", "infra"),
        "needs_reproduction": {"type": "boolean"},
        "suggested_assignee_team": enum("backend", "frontend", "devops", "docs", "security"),
        "summary": text(120),
    }), (
        "Triage this GitHub issue: 'App crashes on startup after upgrading to 2.3.0, stack trace points to the config loader.'",
        "Triage: 'Please add a --json flag to the CLI list command so I can pipe the output.'",
        "Triage: 'The README install instructions mention Python 3.7 but setup.py requires 3.9.'",
        "Triage: 'Password reset tokens never expire, so an old email link still works months later.'",
        "Triage: 'Queries on the orders table got 10x slower since last week's release.'",
        "Triage: 'How do I configure the API client to use a proxy? I could not find it in the docs.'",
        "Triage: 'Dark mode toggle does nothing in Safari 17, works in Chrome.'",
        "Triage: 'The Docker image build fails on ARM64 with an illegal instruction error.'",
        "Triage: 'Dashboard chart labels overlap when there are more than 20 series.'",
        "Invent a realistic issue for a web framework and triage it.",
    )),
    SchemaCase("recipe", schema({
        "name": text(60),
        "servings": integer(1, 12),
        "prep_minutes": integer(0, 240),
        "cook_minutes": integer(0, 480),
        "difficulty": enum("easy", "medium", "hard"),
        "ingredients": array(obj({
            "item": text(40),
            "quantity": number(0, 1000),
            "unit": enum("g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece", "pinch"),
        }), 5, 1),
        "steps": array(text(120), 5, 1),
        "vegetarian": {"type": "boolean"},
    }), (
        "Give me a recipe for classic pancakes for 4 people.",
        "Write a simple vegetarian recipe for tomato soup.",
        "Create a recipe for spaghetti carbonara serving two.",
        "Extract the recipe: 'Guacamole: mash 3 avocados, add 1 tbsp lime juice, a pinch of salt, 50 g diced onion; serves 4, 10 minutes, no cooking'.",
        "Invent a hard baking recipe for a weekend project.",
        "Give me a quick chicken stir-fry recipe that takes under 30 minutes.",
        "Write a recipe for overnight oats with berries.",
        "Create a recipe for a vegan chickpea curry for six.",
        "Make up a recipe that uses leftover rice.",
        "Give me a recipe for chocolate chip cookies, medium difficulty.",
    )),
    SchemaCase("movie_review", schema({
        "title": text(80),
        "year": integer(1888, 2030),
        "rating": integer(1, 5),
        "sentiment": enum("positive", "mixed", "negative"),
        "highlights": array(text(60), 3),
        "would_recommend": {"type": "boolean"},
        "one_line_summary": text(120),
    }), (
        "Review: 'Inception (2010) blew my mind, the score and the spinning hallway fight are unforgettable. 5 stars.'",
        "Extract a review from: 'Cats (2019) was a confusing mess, the CGI was unsettling, skip it.'",
        "Review: 'The Godfather Part III (1990) is fine but nowhere near the first two; Pacino is still great.'",
        "Write a short positive review of Spirited Away.",
        "Invent a review of a fictional 2023 sci-fi thriller that got mixed reactions.",
        "Summarize my opinion: 'Barbie (2023) was funny and smart, loved the costumes, 4/5.'",
        "Review: 'Jaws (1975) still works, the shark barely appears and it is terrifying anyway.'",
        "Write a negative review of a generic action sequel from 2021.",
        "Extract: 'Parasite (2019) - 5/5 - sharp social satire, the staircase scenes, the ending. Must watch.'",
        "Review a classic silent film of your choice.",
    )),
    SchemaCase("address", schema({
        "recipient": text(60),
        "address": ADDRESS,
        "type": enum("home", "work", "billing", "shipping"),
        "phone": {"type": "string", "pattern": "^\\+[0-9]{7,15}$"},
    }), (
        "Parse: 'Ship to John Smith, 221B Baker Street, London NW1 6XE, GB, +447700900123'.",
        "Extract the billing address: Müller GmbH, Hauptstraße 5, 10115 Berlin, Germany, phone +49301234567.",
        "Format this work address: Jane Doe, 1600 Amphitheatre Parkway, Mountain View, CA 94043, US, +16502530000.",
        "Invent a plausible home address in Toronto.",
        "Parse: 'Sato Hiroshi, 1-2-3 Shibuya, Shibuya-ku, Tokyo 150-0002, JP, tel +81312345678 (home)'.",
        "Create a shipping address for a warehouse in Rotterdam.",
        "Extract: 'Deliver to Ana Souza at Rua Augusta 1500, São Paulo, SP 01304-001, Brazil, +5511987654321'.",
        "Make up a billing address for a small company in Sydney.",
        "Parse this: 'Home: Pierre Martin, 12 Rue de Rivoli, 75004 Paris, France, +33142000000'.",
        "Invent a work address for an office in Nairobi.",
    )),
    SchemaCase("flight_booking", schema({
        "booking_reference": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
        "passengers": array(obj({
            "name": text(60),
            "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-K]$"},
            "checked_bags": integer(0, 3),
        }), 4, 1),
        "segments": array(obj({
            "flight_number": {"type": "string", "pattern": "^[A-Z0-9]{2}[0-9]{1,4}$"},
            "from_airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to_airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "pattern": DATE},
            "departure_time": {"type": "string", "pattern": TIME},
        }), 3, 1),
        "cabin": enum("economy", "premium_economy", "business", "first"),
        "total_price": obj({"amount": money(0, 50000), "currency": CURRENCY}),
    }), (
        "Book Alice Chen on LH400 from FRA to JFK on 2024-08-14 at 10:05, seat 23A, one bag, economy, 640 EUR, reference QX7P2L.",
        "Extract the booking: 'Ref ABC123, BA117 LHR-JFK 2024-12-20 08:25, business, passengers Mark Lee 2A and Sue Lee 2C, 2 bags each, 5400 GBP'.",
        "Invent a round trip booking from Paris to Tokyo for two people.",
        "Parse: 'Booking ZZ9K4M: UA901 SFO->LHR 2025-02-03 16:40, then LH921 LHR->MUC 2025-02-04 13:10; pax: Jo Park seat 31F, no bags; economy; 1120 USD'.",
        "Create a first class booking for a single traveller from Dubai to Sydney.",
        "Book a family of four on a domestic economy flight from Chicago to Orlando in July.",
        "Extract: 'AC855 YYZ to LHR, 2024-10-01 at 21:30, premium economy, seat 21D, Ravi Patel, 1 checked bag, 1350 CAD, ref R5T6Y7'.",
        "Invent a multi-city business trip booking with three segments.",
        "Make a booking for Emma Wilson on QF1 from SYD to LHR on 2024-11-30 at 16:00, seat 7K, business, 2 bags.",
        "Create a cheap one-way booking from Madrid to Rome.",
    )),
    SchemaCase("bug_report", schema({
        "title": text(100),
        "severity": enum("blocker", "critical", "major", "minor", "trivial"),
        "environment": obj({
            "os": enum("windows", "macos", "linux", "ios", "android", "other"),
            "app_version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
            "browser": text(40),
        }, optional=("browser",)),
        "steps_to_reproduce": array(text(100), 5, 1),
        "expected_behavior": text(120),
        "actual_behavior": text(120),
        "reproducible": enum("always", "sometimes", "once"),
    }), (
        "Write a bug report: on version 3.2.1 for Android, tapping Save on an empty form crashes the app every time.",
        "Report: in Firefox on Linux with app 1.14.0, uploaded images appear rotated 90 degrees sometimes.",
        "Turn this into a bug report: 'Since 2.0.0 on macOS the export to PDF button does nothing, happened once after sleep.'",
        "Invent a bug report for a calendar app that shows events on the wrong day.",
        "Write a bug report: Windows 11, version 5.0.3, the installer hangs at 99 percent every time.",
        "Report a minor typo on the iOS settings screen in version 4.1.0.",
        "Create a bug report about a checkout page that double-charges customers, version 7.3.2, Chrome on Windows.",
        "Invent a trivial UI bug report for a note-taking app.",
        "Bug: 'On Linux 0.9.12, the CLI ignores the --quiet flag and prints progress bars anyway.'",
        "Write a blocker bug report for a login service that rejects all valid passwords after a deploy.",
    )),
    SchemaCase("text_classification", schema({
        "label": enum("positive", "negative", "neutral"),
        "confidence": number(0, 1),
        "topics": array(enum("price", "quality", "delivery", "support", "usability", "other"), 3, 1),
        "language": {"type": "string", "pattern": "^[a-z]{2}$"},
        "contains_profanity": {"type": "boolean"},
        "rationale": text(120),
    }), (
        "Classify: 'Arrived two days late and the box was crushed, but the blender itself works great.'",
        "Classify: 'Absolutely love it, best purchase I made this year!'",
        "Classify: 'The app is okay I guess, does what it says.'",
        "Classify: 'Support never answered my three emails, I want a refund.'",
        "Classify: 'Trop cher pour ce que c'est, la qualité est médiocre.'",
        "Classify: 'Setup was confusing but once running it is rock solid.'",
        "Classify: 'Der Versand war super schnell, danke!'",
        "Classify: 'This damn thing broke after one week, total garbage.'",
        "Classify: 'Price dropped the day after I bought it, annoying.'",
        "Invent a short customer review and classify it.",
    )),
    SchemaCase("meeting_summary", schema({
        "meeting_title": text(80),
        "date": {"type": "string", "pattern": DATE},
        "participants": array(text(40), 5, 1),
        "decisions": array(text(100), 3),
        "action_items": array(obj({
            "owner": text(40),
            "task": text(100),
            "due_date": {"type": "string", "pattern": DATE},
            "status": enum("open", "in_progress", "done"),
        }), 4),
        "next_meeting": {"anyOf": [{"type": "string", "pattern": DATE}, {"type": "null"}]},
    }), (
        "Summarize: 'Sprint review 2024-05-10 with Ana, Ben, Chloe. Decided to drop the legacy export. Ben fixes the login bug by 2024-05-14. Next review 2024-05-24.'",
        "Summarize this meeting: budget sync on 2024-03-01 between Finance and Marketing, agreed to cut ad spend 10%, Dana sends the revised plan by 2024-03-08.",
        "Invent a summary of a product kickoff meeting with four participants.",
        "Summarize: 'Hiring committee, 2024-09-18: Raj, Lena, Omar. Decision: make an offer to candidate B. Lena drafts offer by 2024-09-20. No follow-up meeting.'",
        "Summarize an incident postmortem meeting about a database outage.",
        "Summarize: 'Weekly ops 2024-07-02 (Mia, Sam): migrate backups to new bucket - Sam, done; rotate API keys - Mia, due 2024-07-09. Next 2024-07-09.'",
        "Invent a summary of a school parent-teacher committee meeting.",
        "Summarize: 'Design critique 2024-02-15 with Yuki and Paul, chose the blue palette, Yuki updates the mockups by 2024-02-19.'",
        "Summarize a short board meeting that approved a new office lease.",
        "Invent a summary of a retrospective where the team decided to change their on-call rotation.",
    )),
    SchemaCase("job_posting", schema({
        "title": text(60),
        "company": text(60),
        "location": obj({
            "city": text(50),
            "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "remote": enum("onsite", "hybrid", "remote"),
        }),
        "employment_type": enum("full_time", "part_time", "contract", "internship"),
        "seniority": enum("junior", "mid", "senior", "lead"),
        "salary_range": obj({"min": integer(0, 1000000), "max": integer(0, 1000000), "currency": CURRENCY}),
        "requirements": array(text(80), 5, 1),
        "benefits": array(text(60), 4),
    }), (
        "Create a posting for a senior backend engineer at Stripe in Dublin, hybrid, 90k-130k EUR, Go and Postgres required.",
        "Extract the job ad: 'Part-time barista at Blue Bottle, San Francisco, onsite, $18-22/hour equivalent 37k-45k USD yearly, coffee passion required.'",
        "Invent a remote junior data analyst posting for a fintech startup.",
        "Write a posting for a summer internship in mechanical engineering at Siemens in Munich.",
        "Parse: 'Lead Product Designer - Canva - Sydney AU - hybrid - full time - 180k-220k AUD - 8+ years, Figma, design systems - benefits: equity, 4 weeks leave'.",
        "Create a six-month contract posting for a DevOps engineer, fully remote, paid in GBP.",
        "Invent a posting for a mid-level nurse recruiter role in Toronto.",
        "Write a job posting for a senior machine learning engineer at a Zurich research lab with a CHF salary.",
        "Create a posting for a part-time English tutor in Tokyo paid in JPY.",
        "Invent a job posting for a lead site reliability engineer at an e-commerce company.",
    )),
    SchemaCase("book_citation", schema({
        "type": enum("book", "article", "chapter", "thesis"),
        "title": text(120),
        "authors": array(obj({"family": text(40), "given": text(40)}), 4, 1),
        "year": integer(1450, 2030),
        "publisher": text(80),
        "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
        "pages": integer(1, 5000),
        "style_hint": enum("apa", "mla", "chicago", "ieee"),
    }, optional=("isbn",)), (
        "Cite: 'The Pragmatic Programmer' by Andrew Hunt and David Thomas, Addison-Wesley, 1999, 352 pages, APA style.",
        "Make a citation for 'Sapiens' by Yuval Noah Harari, Harper, 2015, ISBN 9780062316097.",
        "Create an IEEE citation for 'Deep Learning' by Goodfellow, Bengio and Courville, MIT Press, 2016.",
        "Cite Jane Austen's 'Pride and Prejudice', first published 1813 by T. Egerton, in MLA style.",
        "Invent a citation for a 2019 PhD thesis on coral reef ecology.",
        "Cite 'Thinking, Fast and Slow' by Daniel Kahneman (Farrar, Straus and Giroux, 2011, 499 pages) in Chicago style.",
        "Make a citation for a chapter on distributed consensus in an edited computer science handbook.",
        "Cite 'Structure and Interpretation of Computer Programs' by Abelson and Sussman, MIT Press, 1985.",
        "Invent a book citation for a history of the Silk Road with two authors.",
        "Cite 'Gödel, Escher, Bach' by Douglas Hofstadter, Basic Books, 1979, 777 pages, ISBN 9780465026562.",
    )),
    SchemaCase("weather_report", schema({
        "location": text(60),
        "date": {"type": "string", "pattern": DATE},
        "unit": enum("celsius", "fahrenheit"),
        "current": obj({
            "temperature": integer(-90, 140),
            "condition": enum("sunny", "partly_cloudy", "cloudy", "rain", "snow", "storm", "fog", "windy"),
            "humidity_percent": integer(0, 100),
            "wind_kph": integer(0, 300),
        }),
        "forecast": array(obj({
            "day": enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"),
            "high": integer(-90, 140),
            "low": integer(-90, 140),
            "precipitation_chance_percent": integer(0, 100),
        }), 3, 1),
        "alert": {"anyOf": [text(100), {"type": "null"}]},
    }), (
        "Report: Seattle on 2024-11-12, 9 °C and rain, humidity 88%, wind 20 km/h; forecast Wednesday high 11, low 6, 70% chance of rain.",
        "Make a weather report for Phoenix in July in Fahrenheit with an excessive heat warning.",
        "Invent a three-day winter forecast for Oslo in Celsius.",
        "Parse: 'Miami 2024-09-05: 88F, storm, 90% humidity, wind 65 kph, hurricane watch in effect; Fri high 86 low 79, 80% rain'.",
        "Create a pleasant spring weather report for Kyoto.",
        "Report foggy morning conditions in San Francisco on 2024-08-20 in Fahrenheit.",
        "Invent a weather report for a windy day on the Scottish coast.",
        "Parse: 'Delhi, 2024-05-28, sunny, 46 °C, humidity 12%, wind 15 kph, heatwave alert; Thu 45/31, Fri 44/30, 0% rain'.",
        "Make a snowy weather report for Denver with a two-day forecast.",
        "Invent a mild autumn report for Buenos Aires with no alerts.",
    )),
    SchemaCase("support_ticket_routing", schema({
        "queue": enum("billing", "technical", "account", "shipping", "sales", "abuse"),
        "urgency": enum("low", "normal", "high", "urgent"),
        "customer_tier": enum("free", "pro", "enterprise", "unknown"),
        "language": {"type": "string", "pattern": "^[a-z]{2}$"},
        "escalate_to_human": {"type": "boolean"},
        "suggested_reply": text(120),
        "tags": array(text(24), 3),
    }), (
        "Route: 'I was charged twice for my Pro subscription this month, please refund one.'",
        "Route: 'Our whole enterprise workspace is down and 300 people cannot log in!'",
        "Route: 'Where is my package? Tracking has not updated in 6 days.'",
        "Route: 'Hola, no puedo cambiar mi contraseña, el enlace no funciona.'",
        "Route: 'We are interested in a 500-seat license, can someone send a quote?'",
        "Route: 'Someone is posting spam links from my account, I did not do this.'",
        "Route: 'How do I export my data to CSV on the free plan?'",
        "Route: 'Die API gibt seit heute Morgen nur noch 500er Fehler zurück.'",
        "Route: 'Please delete my account and all my personal data.'",
        "Invent a customer support message and route it.",
    )),
    SchemaCase("code_review_comment", schema({
        "file": {"type": "string", "pattern": "^[A-Za-z0-9_./-]{1,80}$"},
        "line": integer(1, 100000),
        "severity": enum("nit", "suggestion", "warning", "error", "blocker"),
        "category": enum("correctness", "performance", "security", "readability", "style", "testing"),
        "comment": text(120),
        "suggested_fix": {"anyOf": [text(120), {"type": "null"}]},
    }), (
        "Review comment: in src/auth.py line 42 the password is compared with == instead of a constant-time comparison.",
        "Write a nit about an unused import on line 3 of app/main.py.",
        "Review: 'utils/cache.go:118 - the map is read and written from several goroutines without a mutex.'",
        "Invent a code review comment about a missing unit test.",
        "Comment on lib/parser.ts line 207, where a regex is compiled inside a hot loop.",
        "Review comment: SQL string built with f-string from user input in api/search.py at line 57.",
        "Write a readability suggestion for a 200-line function starting at line 10 of core/engine.rs.",
        "Review: 'tests/test_io.py line 88 sleeps for 5 seconds, making CI slow.'",
        "Invent a style comment about inconsistent naming in a Java file.",
        "Flag an off-by-one error in the loop bound on line 31 of src/buffer.c.",
    )),
    SchemaCase("sql_query_plan", schema({
        "query_kind": enum("select", "insert", "update", "delete"),
        "tables": array(obj({
            "name": text(40),
            "access": enum("seq_scan", "index_scan", "index_only_scan", "bitmap_scan"),
            "index": {"anyOf": [text(40), {"type": "null"}]},
        }), 4, 1),
        "join_strategy": enum("none", "nested_loop", "hash_join", "merge_join"),
        "estimated_rows": integer(0, 1000000000),
        "bottleneck": text(100),
        "recommendations": array(text(100), 3),
    }), (
        "Describe the plan for: SELECT * FROM orders WHERE customer_id = 42, with an index on orders(customer_id).",
        "Explain the plan of joining users and sessions on user_id with no indexes, about 2 million rows.",
        "Describe the plan for: UPDATE products SET price = price * 1.1 WHERE category = 'toys'.",
        "Invent a query plan for a slow reporting query over three tables.",
        "Describe the plan for: DELETE FROM logs WHERE created_at < '2023-01-01', logs has a btree on created_at.",
        "Describe the plan for: SELECT count(*) FROM events, a 500 million row table with no filters.",
        "Explain a merge join between two sorted tables invoices and payments on invoice_id.",
        "Describe the plan for: SELECT email FROM users WHERE email = 'a@b.com' with a covering index users_email_idx.",
        "Describe the plan for: INSERT INTO archive SELECT * FROM orders WHERE status = 'closed'.",
        "Invent a plan where a bitmap scan on a tags table is the bottleneck.",
    )),
    SchemaCase("shopping_cart", schema({
        "cart_id": {"type": "string", "pattern": "^[a-z0-9]{8}$"},
        "currency": CURRENCY,
        "items": array(obj({
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "name": text(60),
            "quantity": integer(1, 99),
            "unit_price": money(0, 10000),
        }), 5, 1),
        "coupon": {"anyOf": [{"type": "string", "pattern": "^[A-Z0-9]{4,12}$"}, {"type": "null"}]},
        "shipping_method": enum("standard", "express", "pickup"),
        "subtotal": money(0, 100000),
    }), (
        "Build a cart with 2 packs of AA batteries at $5.99 and one USB-C cable at $12.50, standard shipping.",
        "Create a cart for a birthday party: balloons, paper plates and a cake topper, express shipping.",
        "Invent a shopping cart for a home office setup paid in EUR.",
        "Parse: 'cart k3j9x2pq: 3x BOO-1001 Notebook 4.50 GBP, 1x PEN-2002 Fountain pen 35 GBP, coupon SCHOOL10, pickup'.",
        "Make a grocery cart with five items and no coupon.",
        "Create a cart for camping gear with the coupon SUMMER24.",
        "Invent a cart with a single expensive item paid in JPY.",
        "Build a cart of three different books with express shipping in CAD.",
        "Create a cart for a pet owner buying food, a leash and toys.",
        "Invent a cart for gardening supplies with standard shipping in AUD.",
    )),
    SchemaCase("medical_appointment", schema({
        "patient_alias": text(40),
        "appointment_type": enum("checkup", "follow_up", "vaccination", "consultation", "dental", "eye_exam"),
        "department": enum("general_practice", "pediatrics", "dermatology", "dentistry", "ophthalmology", "physiotherapy"),
        "date": {"type": "string", "pattern": DATE},
        "time": {"type": "string", "pattern": TIME},
        "duration_minutes": integer(10, 120),
        "mode": enum("in_person", "video", "phone"),
        "preparation_notes": array(text(80), 3),
        "reminder": obj({"channel": enum("sms", "email", "none"), "hours_before": integer(0, 72)}),
    }), (
        "Book a routine checkup for patient 'J.D.' on 2024-06-12 at 09:00, 20 minutes, in person, SMS reminder 24 hours before.",
        "Schedule a video follow-up for 'Patient A' in dermatology on 2024-10-03 at 15:30.",
        "Create a pediatric vaccination appointment for a child alias 'Kiddo-7' next Monday morning.",
        "Invent a dental cleaning appointment with email reminders.",
        "Book an eye exam on 2025-01-08 at 11:15 for 'M.K.', 30 minutes, remind by email two days before.",
        "Schedule a 45-minute physiotherapy consultation for 'Runner22' on 2024-08-19 at 17:00.",
        "Create a phone consultation with a general practitioner for 'Anon-3' with no reminder.",
        "Invent a follow-up appointment in ophthalmology for a fictional patient.",
        "Book a video checkup on 2024-12-02 at 08:30 for 'T.S.' with a note to have recent test results ready.",
        "Make up an appointment for a flu shot at a general practice.",
    )),
)


def requests() -> list[tuple[SchemaCase, str]]:
    """The 200 (case, prompt) pairs, schema-major: all of the first case's prompts, then the second's, ..."""
    return [(case, prompt) for case in CASES for prompt in case.prompts]
